"""bench/ttt/headroom.py: the optimistic chain's time and the headroom on planted run directories."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

SEQ = 8


@pytest.fixture(scope="module")
def headroom_module(import_bench):
    return import_bench("ttt.headroom")


def lines(
    stages: list[tuple[int, int, float]], *, first_step_s: float, ppl_at: dict[int, float]
) -> list[dict]:
    """One metrics line per 4 steps. ``stages``: (gbs, lines, seconds a step); the run's first step takes
    ``first_step_s``; ``ppl_at``: the eval perplexity of a line by its number (from 1)."""
    rows, time, iteration, samples = [], 100.0, 0, 0
    for stage, (gbs, count, step_s) in enumerate(stages, start=1):
        for _ in range(count):
            first = not rows
            seconds = (first_step_s + 3 * step_s) if first else 4 * step_s
            time, iteration, samples = time + seconds, iteration + 4, samples + 4 * gbs
            row = {"stage": stage, "dp": 1, "tp": 1, "pp": 1, "iteration": iteration,
                   "consumed_samples": samples, "time": time, "consumed_tokens": samples * SEQ, "gbs": gbs,
                   "mbs": gbs, "steps_in_interval": 4,
                   "step_time_s": seconds / 4, "tokens_per_s": gbs * SEQ * 4 / seconds}  # fmt: skip
            ppl = ppl_at.get(len(rows) + 1)
            rows.append(row if ppl is None else {**row, "eval_ppl": ppl})
    return rows


def write_run(root: Path, name: str, rows: list[dict]) -> None:
    path = root / name / "logs" / name / "metrics.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_headroom_is_the_best_fixed_time_over_the_quickest_start_plus_fewest_tokens_at_the_top_rate(
    headroom_module, tmp_path: Path
) -> None:
    # Fixed gbs 4: 0.1 s a step (320 tokens/s), 2 s first step, reaches ppl 20 at line 10 (160 samples).
    write_run(tmp_path, "fixed-gbs4", lines([(4, 12, 0.1)], first_step_s=2.0, ppl_at={10: 19.0}))
    # Online: gbs 2 then gbs 8, 0.1 s a step (160 and 640 tokens/s), 3 s first step; it reaches the target
    # at its 8th line: 4 lines of 8 samples and 4 of 32, 160 samples.
    online = lines([(2, 4, 0.1), (8, 6, 0.1)], first_step_s=3.0, ppl_at={8: 18.0})
    write_run(tmp_path, "online", online)
    # The warm-up run is not one of the comparison's: its quicker first step must not count.
    write_run(tmp_path, "warmup", lines([(2, 2, 0.1)], first_step_s=0.5, ppl_at={}))
    bound = headroom_module.work_dir_headroom(tmp_path, 20.0)
    out = headroom_module.format_headroom(1, bound)
    runs = {
        name: headroom_module.run_numbers(name, records, 20.0)
        for name, records in headroom_module.measured_runs(tmp_path)
    }
    assert sorted(runs) == ["fixed-gbs4", "online"]
    assert runs["fixed-gbs4"].first_step_s == pytest.approx(2.0)
    assert runs["fixed-gbs4"].time_to_target_s == pytest.approx(2.0 + 39 * 0.1)
    assert runs["online"].tokens_to_target == 160 * SEQ
    assert runs["online"].rates == pytest.approx(
        {"dp1/tp1/pp1 gbs2/mbs2": 160.0, "dp1/tp1/pp1 gbs8/mbs8": 640.0}
    )
    result = headroom_module.headroom(list(runs.values()))
    assert bound["chain_s"] == pytest.approx(result["chain_s"])
    chain_s = 2.0 + 160 * SEQ / 640.0  # the quickest first step, the fewest tokens at the fastest rate
    assert result["chain_s"] == pytest.approx(chain_s)
    assert result["headroom"] == pytest.approx((2.0 + 3.9) / chain_s)
    assert f"at most {result['headroom']:.2f}x faster" in out
    # After the first step: online 3.1 s (31 steps of 0.1 s) against fixed gbs 4's 3.9 s.
    assert headroom_module.after_first_step(list(runs.values())) == pytest.approx({"online": 3.1 / 3.9})
    assert "after the first step, over the best fixed run after its own: online 0.79" in out


def test_a_folder_without_a_fixed_run_at_the_target_has_no_headroom_yet(
    headroom_module, tmp_path: Path
) -> None:
    write_run(tmp_path, "fixed-gbs4", lines([(4, 3, 0.1)], first_step_s=2.0, ppl_at={}))
    write_run(tmp_path, "online", [{"stage": 1, "eval_ppl": 30.0}])  # no training line: left out
    assert headroom_module.work_dir_headroom(tmp_path, 20.0) is None
