"""Where a time-to-target run spends time outside its training steps, and how its first lines ran.

For each run directory of a comparison (``bench/time_to_target.py --work-dir``), from ``metrics.jsonl``:

* the median step time at one gbs (``--gbs``) and the median time an evaluation adds there: a line's
  evaluation runs after its timestamp, so it shows as the next interval's wall time beyond its steps;
* the total wall time between lines that is not step time (evaluations, logging, switches);
* the step time of the first lines (the first holds the first step: compile or warm-up);
* for each later stage at that gbs (an online run's switches), its first three lines' step times: the first
  holds the new micro-batch shape's warm-up, the second is the rate an in-place trial is judged on, the
  third the steady rate it is measured against.

    python3 bench/ttt_overheads.py --work-dir /tmp/ttt-e --gbs 32
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from ttt_report import measured_runs

FIRST_LINES = 4


def overheads(records: list[dict[str, Any]], gbs: int) -> dict[str, Any]:
    """The numbers above for one run's records (lines without a time or step time are left out)."""
    records = [r for r in records if "time" in r and "step_time_s" in r]
    intervals = [  # (the line before, the line, its wall time beyond its steps)
        (
            a,
            b,
            float(b["time"])
            - float(a["time"])
            - float(b["step_time_s"]) * int(b.get("steps_in_interval", 1)),
        )
        for a, b in zip(records, records[1:], strict=False)
    ]
    at_gbs = [(a, b, gap) for a, b, gap in intervals if a["gbs"] == gbs and b["gbs"] == gbs]
    after_eval = [gap for a, b, gap in at_gbs if "eval_ppl" in a and "eval_ppl" not in b]
    return {
        "step_ms": 1e3 * statistics.median(float(b["step_time_s"]) for _, b, _ in at_gbs) if at_gbs else None,
        "eval_ms": 1e3 * statistics.median(after_eval) if after_eval else None,
        "outside_s": sum(gap for _, _, gap in intervals),
        "first_lines_ms": [round(1e3 * float(r["step_time_s"]), 1) for r in records[:FIRST_LINES]],
        "stage_starts_ms": stage_starts(records, gbs),
    }


def stage_starts(records: list[dict[str, Any]], gbs: int) -> dict[int, list[float]]:
    """Step ms of the first three lines of each stage after the run's first that trains at ``gbs``."""
    by_stage: dict[int, list[float]] = {}
    for record in records:
        stage = int(record.get("stage", 1))
        if stage != int(records[0].get("stage", 1)) and record["gbs"] == gbs:
            by_stage.setdefault(stage, []).append(round(1e3 * float(record["step_time_s"]), 1))
    return {stage: times[:3] for stage, times in by_stage.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", type=Path, required=True, help="a time_to_target.py --work-dir")
    parser.add_argument("--gbs", type=int, required=True, help="the gbs whose steps and evaluations to time")
    args = parser.parse_args(argv)
    for name, records in measured_runs(args.work_dir):
        found = overheads(records, args.gbs)
        step = "-" if found["step_ms"] is None else f"{found['step_ms']:.1f} ms"
        evaluation = "-" if found["eval_ms"] is None else f"{found['eval_ms']:.1f} ms"
        print(
            f"{name:>12}: at gbs {args.gbs} a step {step}, an evaluation adds {evaluation}; "
            f"{found['outside_s']:.2f} s outside the steps; "
            f"first lines (ms a step) {found['first_lines_ms']}; "
            f"later stages' first three lines {found['stage_starts_ms']}"
        )


if __name__ == "__main__":
    main()
