"""A time-to-target run's start-up in two parts: its runner until the first stage is planned, then its workers
until the first training step.

For each run of a comparison's JSON (``bench/time_to_target.py --out``), from its ``startup_s`` (launch to the
first step) and its run directory under ``--work-dir`` (``runner_state.json``: the first stage's
``planned_at``; ``metrics.jsonl``: the first step's start). The runner's part is what online mode adds to the
start-up (its imports, its initial search), the workers' part is the same code in every mode. The JSON's
``runner_s`` gives the first part since 2099ee5; this reads it back from the run files for JSON without it::

    python3 bench/ttt_startup.py --json ttt.json --work-dir /tmp/ttt-e
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ttt_report import read_jsonl, runner_seconds, step_start


def startup_split(row: dict[str, Any], run_dir: Path) -> dict[str, float] | None:
    """``{"startup_s", "runner_s", "workers_s"}`` of one row, or None without its run files."""
    records = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "time" in r and "step_time_s" in r]
    if not records or row.get("startup_s") is None:
        return None
    first_step = step_start(records[0])
    launched = first_step - float(row["startup_s"])
    runner = runner_seconds(run_dir, launched)
    if runner is None:
        return None
    return {
        "startup_s": float(row["startup_s"]),
        "runner_s": runner,
        "workers_s": round(first_step - launched - runner, 2),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, required=True, help="time_to_target.py --out")
    parser.add_argument("--work-dir", type=Path, required=True, help="time_to_target.py --work-dir")
    args = parser.parse_args(argv)
    for row in json.loads(args.json.read_text())["runs"]:
        name = row["run"]
        split = startup_split(row, args.work_dir / name / "logs" / name)
        if split is None:
            print(f"{name}: no run files")
            continue
        print(
            f"{name}: start-up {split['startup_s']:.1f} s = runner {split['runner_s']:.2f} s "
            f"+ workers {split['workers_s']:.2f} s"
        )


if __name__ == "__main__":
    main()
