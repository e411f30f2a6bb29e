"""When online runs settled on their final batch size, and what it cost them, over several comparisons.

For each online run of each ``bench/time_to_target.py --work-dir`` given: the tokens it had consumed when it
took up, for the last time, a global batch at least as large as the one it reached the target at (its
*settle point*), the tokens it needed to reach the target, and its time to the target after its first step
over its own call's best fixed run's (``bench/ttt_headroom.py``'s measure: free of the start's scatter).
Then the runs grouped by settle point (``--bins``, in millions of tokens). A run that settles early spends
fewer tokens at the slow small batches but needs more tokens in all; one that settles late the reverse.
Which side costs more time, and how much any settle point could give, is what the groups show. Last, each
run's time over the fixed run's split into its tokens over the fixed run's times the fixed run's mean speed
over its own (the "speed cost"), over all runs: the means, spreads and how far the two cancel.

    python3 bench/ttt_settle.py /tmp/ttt-e29 /tmp/ttt-e30 --target-ppl 20 --bins 1,3
"""

from __future__ import annotations

import argparse
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ttt_headroom import after_first_step, run_numbers
from ttt_report import first_at_or_below, measured_runs


@dataclass(frozen=True)
class Settled:
    call: str
    run: str
    settle_tokens: int
    tokens_to_target: int
    over_best_fixed: float | None
    """Time to the target after the first step over the call's best fixed run's (None: no fixed run)."""
    fixed_tokens: int | None = None
    """The tokens that best fixed run needed (None: no fixed run)."""

    def split(self) -> tuple[float, float] | None:
        """(tokens over the fixed run's, speed cost): their product is :attr:`over_best_fixed`."""
        if self.over_best_fixed is None or not self.fixed_tokens:
            return None
        tokens = self.tokens_to_target / self.fixed_tokens
        return tokens, self.over_best_fixed / tokens


def settle_tokens(records: list[dict[str, Any]], target_ppl: float) -> int | None:
    """Tokens consumed before the last stretch of lines, up to the target's, at the target's gbs or more."""
    lines = [r for r in records if "consumed_tokens" in r and "gbs" in r]
    hit = first_at_or_below(lines, target_ppl)
    if hit is None:
        return None
    end = lines.index(hit)
    start = end
    while start > 0 and lines[start - 1]["gbs"] >= hit["gbs"]:
        start -= 1
    return 0 if start == 0 else int(lines[start - 1]["consumed_tokens"])


def settled_runs(work_dir: Path, target_ppl: float) -> list[Settled]:
    """The online runs of one comparison that reached the target (names not starting ``fixed``)."""
    runs = measured_runs(work_dir)
    numbers = [run_numbers(name, records, target_ppl) for name, records in runs]
    ratios = after_first_step(numbers)
    fixed = [n for n in numbers if n.name.startswith("fixed") and n.time_to_target_s is not None]
    best = min(fixed, key=lambda n: n.time_to_target_s - n.first_step_s) if fixed else None
    settled = []
    for name, records in runs:
        if name.startswith("fixed"):
            continue
        settle = settle_tokens(records, target_ppl)
        if settle is None:
            continue
        hit = first_at_or_below(records, target_ppl)
        fixed_tokens = None if best is None else best.tokens_to_target
        tokens = int(hit["consumed_tokens"])
        settled.append(Settled(work_dir.name, name, settle, tokens, ratios.get(name), fixed_tokens))
    return settled


def groups(runs: list[Settled], bins_m: list[float]) -> list[tuple[str, list[Settled]]]:
    """``runs`` split at the settle points ``bins_m`` (millions of tokens): (label, runs) per group."""
    edges = [0.0, *sorted(bins_m), float("inf")]
    out = []
    for low, high in zip(edges, edges[1:], strict=False):
        members = [r for r in runs if low * 1e6 <= r.settle_tokens < high * 1e6]
        label = f"settled at {low:g}M+" if high == float("inf") else f"settled at {low:g}-{high:g}M"
        out.append((label, members))
    return out


def mean_and_range(values: list[float], fmt: str) -> str:
    if not values:
        return "-"
    return f"{format(statistics.mean(values), fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def split_summary(runs: list[Settled]) -> str | None:
    """Means and spreads of the tokens ratio and the speed cost, and ``var log time = var log tokens + var
    log cost + 2 cov``: a negative covariance is runs saving tokens by what costs them speed."""
    pairs = [split for split in (r.split() for r in runs) if split is not None]
    if len(pairs) < 2:
        return None
    tokens, cost = [p[0] for p in pairs], [p[1] for p in pairs]
    log_tokens, log_cost = [math.log(x) for x in tokens], [math.log(x) for x in cost]
    log_time = [a + b for a, b in zip(log_tokens, log_cost, strict=True)]
    return (
        f"{len(pairs)} runs: tokens over fixed {statistics.mean(tokens):.3f} "
        f"(sd {statistics.stdev(tokens):.3f}), "
        f"speed cost {statistics.mean(cost):.3f} (sd {statistics.stdev(cost):.3f}); var log time "
        f"{statistics.variance(log_time):.5f} = {statistics.variance(log_tokens):.5f} + "
        f"{statistics.variance(log_cost):.5f} + 2 x {statistics.covariance(log_tokens, log_cost):.5f}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("work_dirs", type=Path, nargs="+", help="time_to_target.py --work-dir folders")
    parser.add_argument("--target-ppl", type=float, required=True)
    parser.add_argument("--bins", default="1,3", help="settle points that split the groups, M tokens")
    args = parser.parse_args(argv)
    runs = [run for work_dir in args.work_dirs for run in settled_runs(work_dir, args.target_ppl)]
    runs.sort(key=lambda r: r.settle_tokens)
    print(f"{'call':<12} {'run':<16} {'settle M':>9} {'tokens M':>9} {'over fixed':>10}")
    for r in runs:
        ratio = "-" if r.over_best_fixed is None else f"{r.over_best_fixed:.3f}"
        settle, tokens = r.settle_tokens / 1e6, r.tokens_to_target / 1e6
        print(f"{r.call:<12} {r.run:<16} {settle:>9.2f} {tokens:>9.2f} {ratio:>10}")
    print(f"\n{'group':<20} {'runs':>4}  {'tokens to target, M':<24} over best fixed (after first step)")
    for label, members in groups(runs, [float(b) for b in args.bins.split(",")]):
        tokens = [r.tokens_to_target / 1e6 for r in members]
        ratios = [r.over_best_fixed for r in members if r.over_best_fixed is not None]
        tokens_text, ratios_text = mean_and_range(tokens, ".2f"), mean_and_range(ratios, ".3f")
        print(f"{label:<20} {len(members):>4}  {tokens_text:<24} {ratios_text}")
    summary = split_summary(runs)
    if summary is not None:
        print(f"\n{summary}")


if __name__ == "__main__":
    main()
