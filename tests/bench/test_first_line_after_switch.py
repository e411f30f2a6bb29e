"""bench/first_line_after_switch.py: the first full line of each stage against its gbs's other lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def first_line(import_bench):
    return import_bench("first_line_after_switch")


def line(stage: int, gbs: int, step_s: float, *, steps: int = 8, warmup: int | None = None) -> dict:
    row = {"stage": stage, "gbs": gbs, "step_time_s": step_s, "steps_in_interval": steps}
    return {**row, "warmup_steps": warmup} if warmup else row


def planted() -> list[dict]:
    """Stage 1 at gbs 8 (the run's start); a trial of 16 whose first full line (after a short, warm-up
    line) is 1.2x slow; 32 at its usual rate; back to 16 with a first line 0.9x; the usual rates 40 ms at
    16 and 60 ms at 32, six more lines each."""
    return [
        line(1, 8, 0.5, warmup=2), line(1, 8, 0.03),
        line(2, 16, 0.3, steps=3, warmup=1), line(2, 16, 0.048), line(2, 16, 0.040),
        line(3, 32, 0.060), *[line(3, 32, 0.060) for _ in range(6)],
        line(4, 16, 0.036), *[line(4, 16, 0.040) for _ in range(5)],
    ]  # fmt: skip


def test_each_stage_after_the_first_is_its_first_full_line_over_the_others_at_its_gbs(first_line) -> None:
    ratios = first_line.first_line_ratios(planted())
    assert [(stage, gbs) for stage, gbs, _ in ratios] == [(2, 16), (3, 32), (4, 16)]
    assert [ratio for _, _, ratio in ratios] == pytest.approx([1.2, 1.0, 0.9])


def test_a_stage_without_enough_other_lines_at_its_gbs_is_left_out(first_line) -> None:
    records = planted()[:-3]  # gbs 16: three other full lines, not five
    assert [stage for stage, _, _ in first_line.first_line_ratios(records)] == [3]


def test_the_summary_counts_both_tails(first_line, tmp_path: Path, capsys) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in planted()))
    first_line.main([str(path)])
    out = capsys.readouterr().out
    assert "3 stages" in out and "median 1.000" in out and "1 over 1.05, 1 under 0.95" in out
