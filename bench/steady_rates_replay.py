"""Which evaluations of an online run `cona.metrics_record.steady_rates` changes, replayed on its lines.

At each metrics line of a stage the search measures the stage's rate from the lines so far. This replays
``metrics.jsonl`` and lists, per stage, the evaluations at which the steady lines differ from "every line
after the first" (what the search used before a66de6e), with both rates::

    PYTHONPATH=src python3 bench/steady_rates_replay.py WORK/online/logs/online
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from cona.metrics_record import read_metrics, steady_rates


def changed_evaluations(rates: list[float]) -> list[tuple[int, float, float]]:
    """(line number from 1, the old median, the steady median) where the two differ."""
    changed = []
    for lines in range(2, len(rates) + 1):
        old, steady = rates[1:lines], steady_rates(rates[:lines])
        if steady != old:
            changed.append((lines, statistics.median(old), statistics.median(steady)))
    return changed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="an online run's log folder (its metrics.jsonl)")
    args = parser.parse_args(argv)
    stages: dict[int, list[float]] = {}
    for record in read_metrics(args.run_dir / "metrics.jsonl"):
        if record.tokens_per_s is not None and record.stage is not None:
            stages.setdefault(record.stage, []).append(float(record.tokens_per_s))
    for stage, rates in sorted(stages.items()):
        changes = changed_evaluations(rates)
        where = "; ".join(f"line {n}: {old:,.0f} -> {new:,.0f} tokens/s" for n, old, new in changes) or "none"
        print(f"stage {stage}: {len(rates)} lines; evaluations changed: {where}")


if __name__ == "__main__":
    main()
