"""bench/steady_rates_replay.py: the evaluations the steady-rate rule changes, on a planted run."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def replay_module(import_bench):
    return import_bench("steady_rates_replay")


def test_only_the_evaluations_with_a_warm_up_line_change(replay_module, tmp_path, capsys) -> None:
    rates = {1: [50.0, 100.0, 110.0, 90.0], 2: [60.0, 70.0, 180.0, 190.0]}  # stage 2: a warm-up line
    lines = [
        {"stage": s, "iteration": i, "tokens_per_s": r} for s, rs in rates.items() for i, r in enumerate(rs)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert replay_module.changed_evaluations(rates[1]) == []
    assert replay_module.changed_evaluations(rates[2]) == [(3, 125.0, 180.0), (4, 180.0, 185.0)]
    replay_module.main([str(tmp_path)])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "stage 1: 4 lines; evaluations changed: none"
    assert out[1].startswith("stage 2: 4 lines; evaluations changed: line 3: 125 -> 180 tokens/s")
