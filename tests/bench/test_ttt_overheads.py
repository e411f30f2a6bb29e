"""bench/ttt_overheads.py: step time, evaluation cost and time outside the steps on planted lines."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def overheads_module(import_bench):
    return import_bench("ttt_overheads")


def test_an_evaluation_shows_as_the_next_intervals_time_beyond_its_steps(overheads_module) -> None:
    lines, time = [], 0.0
    for index in range(6):  # 4 steps of 0.05 s a line; the lines after an evaluation take 0.03 s more
        extra = 0.03 if index and "eval_ppl" in lines[-1] else 0.0
        time += 4 * 0.05 + extra
        line = {"gbs": 32, "time": time, "step_time_s": 0.05, "steps_in_interval": 4}
        lines.append({**line, "eval_ppl": 50.0} if index % 2 else line)
    found = overheads_module.overheads(lines, gbs=32)
    assert found["step_ms"] == pytest.approx(50.0)
    assert found["eval_ms"] == pytest.approx(30.0)
    assert found["outside_s"] == pytest.approx(2 * 0.03)  # the lines after evaluations 1 and 3 (5 is last)
    assert found["first_lines_ms"] == [50.0] * 4
    assert overheads_module.overheads(lines, gbs=16)["step_ms"] is None


def test_each_later_stage_at_the_gbs_gives_its_first_three_lines(overheads_module) -> None:
    steps = [(1, 8, 40.0), (1, 8, 40.0), (2, 32, 130.0), (2, 32, 50.0), (2, 32, 51.0), (2, 32, 52.0),
             (3, 64, 150.0), (4, 32, 60.0), (4, 32, 50.0)]  # fmt: skip
    lines = [{"stage": stage, "gbs": gbs, "time": float(i), "step_time_s": ms / 1e3, "steps_in_interval": 1}
             for i, (stage, gbs, ms) in enumerate(steps)]  # fmt: skip
    assert overheads_module.stage_starts(lines, 32) == {2: [130.0, 50.0, 51.0], 4: [60.0, 50.0]}
    assert overheads_module.stage_starts(lines, 8) == {}  # the run's first stage is its start, not a switch
