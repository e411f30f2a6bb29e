"""The least time over the best fixed run that an online run starting at G0 must take to each ladder level.

Online mode starts at the user's initial gbs (G0) and cannot decide before its second metrics line: the first
holds the start-up, and the second gives the first rate of G0 (and, with it, the noise scale's first
estimate). Until then it trains at G0 however much better a larger batch would be. Give it everything after
that for free: at its second line it jumps, at no cost, onto the token path of the best fixed run at each
level, credited with the tokens it trained at G0 as if they were that run's. Then it reaches the level at

    floor = its own second line's time + (best fixed time to the level - best fixed time to those tokens)

all from each run's first step. Where ``floor / best`` exceeds a ratio the ladder asks for (1.05), no policy
that ends on a fixed run's path meets it at that level with this G0 and host: the cost is the G0 lines
themselves (a chain could beat the fixed paths only where mixing batches pays, which early on, where the
best fixed run is one batch from G0, it hardly can). It is a floor, not an
estimate: it leaves out the first step at each new micro-batch shape, the switch gaps and the lines a
decision waits for (G0's tokens, worth more than a larger batch's early on, are the one thing it undercounts).

    python3 bench/ttt_start_floor.py --work-dir /tmp/ttt-c1 --target-ppl 20
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ttt_report import LADDER, first_at_or_below, measured_runs, step_start


def elapsed_at_tokens(records: list[dict[str, Any]], tokens: float) -> float:
    """Seconds from the run's first step until it had consumed ``tokens`` (linear between lines; the first
    line's time stands for anything up to its tokens, first step included)."""
    start, before = step_start(records[0]), (0.0, 0.0)
    for record in records:
        at = (float(record["consumed_tokens"]), float(record["time"]) - start)
        if at[0] >= tokens:
            if before[0] == 0.0:
                return at[1]
            return before[1] + (at[1] - before[1]) * (tokens - before[0]) / (at[0] - before[0])
        before = at
    raise SystemExit(f"the run never consumed {tokens:,.0f} tokens")


def second_line(records: list[dict[str, Any]]) -> tuple[float, float]:
    """(seconds from the first step, tokens) at the run's second metrics line, its earliest decision."""
    lines = [r for r in records if "step_time_s" in r]
    if len(lines) < 2:
        raise SystemExit("the online run has fewer than two metrics lines")
    return float(lines[1]["time"]) - step_start(lines[0]), float(lines[1]["consumed_tokens"])


def level_time(records: list[dict[str, Any]], level: float) -> float | None:
    hit = first_at_or_below(records, level)
    return None if hit is None else float(hit["time"]) - step_start(records[0])


def floors(runs: dict[str, list[dict[str, Any]]], levels: list[float]) -> list[dict[str, Any]]:
    """Per level: the best fixed run there, online's time, the floor and both over the best."""
    online = runs["online"]
    decided_s, decided_tokens = second_line(online)
    rows = []
    for level in levels:
        fixed = {n: level_time(r, level) for n, r in runs.items() if n.startswith("fixed")}
        reached = {name: seconds for name, seconds in fixed.items() if seconds is not None}
        if not reached:
            continue
        best = min(reached, key=reached.__getitem__)
        best_s = reached[best]
        floor_s = decided_s + best_s - elapsed_at_tokens(runs[best], decided_tokens)
        online_s = level_time(online, level)
        rows.append({
            "level": level, "best_fixed": best, "best_s": best_s, "floor_s": floor_s,
            "floor_over_best": floor_s / best_s,
            "online_over_best": None if online_s is None else online_s / best_s,
        })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", type=Path, required=True, help="a time_to_target.py --work-dir")
    parser.add_argument("--target-ppl", type=float, required=True)
    args = parser.parse_args(argv)
    runs = {name: [r for r in rows if "step_time_s" in r] for name, rows in measured_runs(args.work_dir)}
    if "online" not in runs:
        raise SystemExit(f"no online run in {args.work_dir}")
    decided_s, decided_tokens = second_line(runs["online"])
    print(f"online's second line: {decided_s:.2f} s from its first step, {decided_tokens:,.0f} tokens")
    for row in floors(runs, [args.target_ppl * factor for factor in (1.0, *LADDER)]):
        online = "-" if row["online_over_best"] is None else f"{row['online_over_best']:.2f}"
        print(
            f"ppl {row['level']:>6g}: best fixed {row['best_fixed']} {row['best_s']:.1f} s; floor "
            f"{row['floor_s']:.1f} s = {row['floor_over_best']:.2f}x; online {online}x"
        )


if __name__ == "__main__":
    main()
