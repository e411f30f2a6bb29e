"""bench/ttt_settle.py: settle points, tokens to target and groups on planted run directories."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

SEQ = 8


@pytest.fixture(scope="module")
def settle_module(import_bench):
    return import_bench("ttt_settle")


def lines(gbs_per_line: list[int], *, ppl_at: dict[int, float], step_s: float = 0.1) -> list[dict]:
    """One metrics line per 4 steps at each line's gbs; the first step of the run takes 1 s more."""
    rows, time, samples, stage = [], 100.0, 0, 0
    for number, gbs in enumerate(gbs_per_line, start=1):
        stage += number == 1 or gbs != gbs_per_line[number - 2]
        seconds = 4 * step_s + (1.0 if number == 1 else 0.0)
        time, samples = time + seconds, samples + 4 * gbs
        row = {"stage": stage, "iteration": 4 * number, "consumed_samples": samples, "time": time,
               "consumed_tokens": samples * SEQ, "gbs": gbs, "mbs": gbs, "steps_in_interval": 4,
               "step_time_s": seconds / 4, "tokens_per_s": gbs * SEQ * 4 / seconds}  # fmt: skip
        rows.append({**row, "eval_ppl": ppl_at[number]} if number in ppl_at else row)
    return rows


def write_run(root: Path, name: str, rows: list[dict]) -> None:
    path = root / name / "logs" / name / "metrics.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_the_settle_point_is_the_start_of_the_last_stretch_at_the_targets_gbs_or_more(settle_module) -> None:
    # gbs 2, 2, a trial of 8, back to 4, then 8 to the target: settled after line 4, not line 2.
    records = lines([2, 2, 8, 4, 8, 8], ppl_at={6: 19.0})
    assert settle_module.settle_tokens(records, 20.0) == 4 * SEQ * (2 + 2 + 8 + 4)
    # Reached at gbs 16: settled where gbs 16 began (the stretch at 8 before it does not count).
    records = lines([2, 2, 8, 4, 8, 16, 16], ppl_at={7: 19.0})
    assert settle_module.settle_tokens(records, 20.0) == 4 * SEQ * (2 + 2 + 8 + 4 + 8)
    # Reached at gbs 8 after a stretch at 16: the settle point is where the gbs first reached 8 for good.
    records = lines([2, 8, 4, 8, 16, 8], ppl_at={6: 19.0})
    assert settle_module.settle_tokens(records, 20.0) == 4 * SEQ * (2 + 8 + 4)
    # One batch size throughout: settled from the start. Not reached: no settle point.
    assert settle_module.settle_tokens(lines([8, 8], ppl_at={2: 19.0}), 20.0) == 0
    assert settle_module.settle_tokens(lines([8, 8], ppl_at={2: 21.0}), 20.0) is None


def test_runs_of_several_calls_are_grouped_by_settle_point_against_their_own_fixed_run(
    settle_module, tmp_path: Path, capsys
) -> None:
    early, late = tmp_path / "call-a", tmp_path / "call-b"
    write_run(early, "fixed-gbs8", lines([8] * 10, ppl_at={10: 19.0}))
    write_run(early, "online", lines([2, 2, 8, 8, 8, 8], ppl_at={6: 19.5}))
    write_run(late, "fixed-gbs8", lines([8] * 10, ppl_at={10: 19.0}))
    write_run(late, "online", lines([2] * 30 + [8], ppl_at={31: 19.5}))
    write_run(late, "online-slow", lines([2] * 5, ppl_at={5: 30.0}))  # never reached: left out
    runs = settle_module.settled_runs(early, 20.0) + settle_module.settled_runs(late, 20.0)
    assert [(r.call, r.run, r.settle_tokens) for r in runs] == [
        ("call-a", "online", 4 * SEQ * 4),
        ("call-b", "online", 4 * SEQ * 60),
    ]
    # After the first step (1.1 s: its line less three 0.1 s steps), a run of N lines of 0.4 s takes
    # 0.4 N - 0.1 s to its target line: the fixed run 3.9 s.
    assert runs[0].over_best_fixed == pytest.approx(2.3 / 3.9)
    assert runs[1].over_best_fixed == pytest.approx(12.3 / 3.9)
    assert runs[0].tokens_to_target == 4 * SEQ * (2 + 2 + 4 * 8)
    # Split: tokens over the fixed run's (36 of 80 samples' lines) times the speed cost, whose product is
    # the time ratio.
    tokens, cost = runs[0].split()
    assert tokens == pytest.approx(36 / 80) and tokens * cost == pytest.approx(2.3 / 3.9)
    grouped = dict(settle_module.groups(runs, [1.0e-3]))  # split at 1,000 tokens
    assert [r.call for r in grouped["settled at 0-0.001M"]] == ["call-a"]
    assert [r.call for r in grouped["settled at 0.001M+"]] == ["call-b"]
    settle_module.main([str(early), str(late), "--target-ppl", "20", "--bins", "0.001"])
    out = capsys.readouterr().out
    rows = {line.split("  ")[0]: line.split() for line in out.splitlines() if line.startswith("settled")}
    assert rows["settled at 0-0.001M"][3] == "1" and rows["settled at 0.001M+"][3] == "1"
    assert "0.590 (0.590-0.590)" in out and "online-slow" not in out
    assert "2 runs: tokens over fixed" in out  # the split's summary line
