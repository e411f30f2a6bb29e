"""Is the first metrics line after a switch slower than its batch size's usual rate? (issue 16)

A trial of a larger batch is judged on its first full metrics line, so a warm-up cost in that line would
bias every trial against the larger batch. For each stage after the first of each online run's
``metrics.jsonl``: the step time of the stage's first full line (as many steps as the run's usual line,
no warm-up steps in it) over the median step time of the other full lines at the same gbs in the run
(the first full lines of stages left out), then the median, quartiles and tails of that ratio over all
stages. Near 1 with tails on both sides: noise, not a bias.

    python3 bench/first_line_after_switch.py WORK/online/logs/online/metrics.jsonl ...
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

MIN_OTHERS = 5
"""Other full lines at the gbs a stage's ratio needs."""


def full_lines(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Lines with the run's most common step count and no warm-up step."""
    lines = [r for r in records if "step_time_s" in r and "steps_in_interval" in r]
    if not lines:
        return []
    usual = Counter(r["steps_in_interval"] for r in lines).most_common(1)[0][0]
    return [r for r in lines if r["steps_in_interval"] == usual and not r.get("warmup_steps")]


def first_line_ratios(records: list[dict[str, Any]]) -> list[tuple[int, int, float]]:
    """(stage, gbs, first full line's step time over the median of the others at its gbs), stages 2 on."""
    full = full_lines(records)
    if not full:
        return []
    run_start = min(r["stage"] for r in records if "stage" in r)  # no switch before it
    firsts: dict[int, dict[str, Any]] = {}
    for line in full:
        firsts.setdefault(line["stage"], line)
    first_ids = {id(line) for line in firsts.values()}
    ratios = []
    for stage, line in sorted(firsts.items()):
        others = [r["step_time_s"] for r in full if r["gbs"] == line["gbs"] and id(r) not in first_ids]
        if stage > run_start and len(others) >= MIN_OTHERS:
            ratios.append((stage, line["gbs"], line["step_time_s"] / statistics.median(others)))
    return ratios


def summary(ratios: list[float]) -> str:
    if len(ratios) < 2:
        return f"{len(ratios)} stages: too few for quartiles"
    low, _, high = statistics.quantiles(ratios, n=4)
    slow, fast = sum(r > 1.05 for r in ratios), sum(r < 0.95 for r in ratios)
    median = statistics.median(ratios)
    return (
        f"{len(ratios)} stages: first full line over the gbs's other lines, median {median:.3f}, "
        f"quartiles {low:.3f}-{high:.3f}; {slow} over 1.05, {fast} under 0.95"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("metrics", type=Path, nargs="+", help="online runs' metrics.jsonl")
    args = parser.parse_args(argv)
    every = []
    for path in args.metrics:
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        for stage, gbs, ratio in first_line_ratios(records):
            print(f"{path}: stage {stage} gbs {gbs}: {ratio:.3f}")
            every.append(ratio)
    print(summary(every))


if __name__ == "__main__":
    main()
