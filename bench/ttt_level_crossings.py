"""When each run of a time-to-target comparison crossed each ladder level, between its evaluations.

``ttt_report`` times a level at the first evaluation at or below it, so a run's time there moves by up to one
evaluation interval (every 262,144 tokens in the bench presets: ~1.1 s at gbs 16 eager on the H200, a fifth
of the time to the easiest levels) with where its evaluations happen to fall. Here the crossing is
interpolated between the last evaluation above the level and the first at or below it, linear in log
perplexity against tokens and against time, for every run alike. The eval set is fixed, so two runs that
trained the same samples evaluate alike; what moves a crossing is the training, not the measurement.

Per level it prints the tokens each run needed and online's time over the best fixed run's (and each online
variant's), interpolated and as the report counts it (first evaluation at or below), all from each run's
first step.

    python3 bench/ttt_level_crossings.py --work-dir /tmp/ttt-c1 --target-ppl 20
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from ttt_report import LADDER, first_at_or_below, measured_runs, step_start


def crossing(records: list[dict[str, Any]], level: float) -> tuple[float, float] | None:
    """(tokens, seconds from the first step) where the run's eval perplexity crossed ``level``,
    interpolated in log perplexity; the first evaluation's own point if it is already at or below it."""
    start = step_start(records[0])
    above = None
    for record in records:
        ppl = record.get("eval_ppl")
        if ppl is None:
            continue
        point = (float(record["consumed_tokens"]), float(record["time"]) - start, math.log(ppl))
        if ppl <= level:
            if above is None:
                return point[0], point[1]
            share = (above[2] - math.log(level)) / (above[2] - point[2])
            return above[0] + share * (point[0] - above[0]), above[1] + share * (point[1] - above[1])
        above = point
    return None


def level_rows(runs: dict[str, list[dict[str, Any]]], levels: list[float]) -> list[dict[str, Any]]:
    """Per level: each run's interpolated crossing, and online over the best fixed run both ways."""
    rows = []
    for level in levels:
        crossings = {name: crossing(records, level) for name, records in runs.items()}
        firsts = {name: first_at_or_below(records, level) for name, records in runs.items()}
        row: dict[str, Any] = {"level": level, "tokens": {n: c and c[0] for n, c in crossings.items()}}
        for way, seconds in (
            ("interpolated", {n: c and c[1] for n, c in crossings.items()}),
            ("first_eval", {n: r and float(r["time"]) - step_start(runs[n][0]) for n, r in firsts.items()}),
        ):
            fixed = {n: s for n, s in seconds.items() if n.startswith("fixed") and s is not None}
            online = {n: s for n, s in seconds.items() if n.startswith("online") and s is not None}
            if not fixed or not online:
                row[way] = None
                continue
            best = min(fixed, key=fixed.__getitem__)
            over_best = {name: online_s / fixed[best] for name, online_s in online.items()}
            row[way] = {
                "best_fixed": best,
                "best_s": fixed[best],
                "online_over_best": over_best.get("online"),
                "over_best": over_best,  # online and its variants (time_to_target --online-variant)
            }
        rows.append(row)
    return rows


def _ratios(over_best: dict[str, float]) -> str:
    """``0.84`` for online alone; ``online 0.84, online-ema1 0.80`` beside its variants."""
    if list(over_best) == ["online"]:
        return f"{over_best['online']:.2f}"
    return ", ".join(f"{name} {ratio:.2f}" for name, ratio in sorted(over_best.items()))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", type=Path, required=True, help="a time_to_target.py --work-dir")
    parser.add_argument("--target-ppl", type=float, required=True)
    args = parser.parse_args(argv)
    runs = {name: [r for r in rows if "time" in r] for name, rows in measured_runs(args.work_dir)}
    names = sorted(runs)
    print("ppl     " + " ".join(f"{name:>12}" for name in names) + "   (tokens, M)   online / best fixed")
    for row in level_rows(runs, [args.target_ppl * factor for factor in (1.0, *LADDER)]):
        tokens = " ".join(
            f"{row['tokens'][n] / 1e6:12.3f}" if row["tokens"][n] is not None else f"{'-':>12}" for n in names
        )
        ratios = "; ".join(
            f"{way} {_ratios(row[way]['over_best'])} ({row[way]['best_fixed']} {row[way]['best_s']:.1f} s)"
            for way in ("interpolated", "first_eval")
            if row[way] is not None
        )
        print(f"{row['level']:<7g} {tokens}   {ratios}")


if __name__ == "__main__":
    main()
