"""An estimate of a fixed run a comparison did not make, from the rate its host ran that batch at.

Most time-to-target calls ran only fixed gbs 32 beside online (to save device time); whether fixed gbs 16
would have been faster on the same host was left open. The training is deterministic enough that a fixed
run needs about the same tokens on every host (fixed gbs 16: 14.16M to ppl 20 in several calls), while the
hosts' eager rates differ by up to 1.5x. So, per call: the host's steady rate at that batch (the fastest
median over any run's stages at it, ``ttt_headroom.stage_rates``: online runs train there too), the
tokens given with ``--tokens`` (from a call that ran it), and the call's quickest first step give

    estimated time = overhead x (quickest first step + tokens / rate)

where ``overhead`` is the call's measured best fixed run's time over the same sum of its own (the
evaluations and the lines' time outside the steady rate: 1.04-1.07 in e21-e41, printed beside it). Each
online run's time from its first step is then printed over the measured best fixed run and over the better
of it and the estimate; the last line averages the runs ``--mean-of`` names. An estimate, not a
measurement: a run's one-line stage is no steady rate (left out), and a fixed run's evaluation could cross
the target a line earlier or later. Checked on e38 (H100), which ran fixed gbs 16: a folder with only its
fixed gbs 32 and fixed gbs-16-at-8e-4 runs gives 57.2 s; fixed gbs 16 measured 57.5 s.

    python3 bench/missing_fixed.py --gbs 16 --tokens 14.16e6 --target-ppl 20 WORK...
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from ttt_headroom import RunNumbers, run_numbers
from ttt_report import measured_runs


def host_rate(runs: list[RunNumbers], gbs: int) -> float | None:
    """The fastest steady rate any run of the call measured at ``gbs`` (any micro-batch size)."""
    rates = [rate for run in runs for label, rate in run.rates.items() if label.startswith(f"gbs{gbs}/")]
    return max(rates) if rates else None


def overhead(run: RunNumbers) -> float:
    """A fixed run's time to the target over its first step plus its tokens at its steady rate."""
    (rate,) = run.rates.values()
    return run.time_to_target_s / (run.first_step_s + run.tokens_to_target / rate)


@dataclass(frozen=True)
class CallRow:
    """One call: its measured best fixed run, the estimate at ``--gbs`` and its online runs' times."""

    call: str
    best: RunNumbers | None
    rate: float | None
    estimate: float | None
    """None where the call measured the run, or lacks a rate at that gbs or a fixed run to scale by."""
    measured: bool
    online: dict[str, float | None]

    def ratios(self) -> dict[str, tuple[float, float]]:
        """Each online run that reached the target: over the measured best fixed run, and over the better of
        it and the estimate."""
        if self.best is None:
            return {}
        best_s = self.best.time_to_target_s
        against = best_s if self.estimate is None else min(best_s, self.estimate)
        return {name: (s / best_s, s / against) for name, s in self.online.items() if s is not None}


def call_row(name: str, runs: list[RunNumbers], gbs: int, tokens: float) -> CallRow:
    fixed = [r for r in runs if r.name.startswith("fixed") and r.time_to_target_s is not None]
    best = min(fixed, key=lambda r: r.time_to_target_s) if fixed else None
    measured_here = any(r.name == f"fixed-gbs{gbs}" for r in runs)
    rate = host_rate(runs, gbs)
    estimate = None
    if rate is not None and not measured_here and best is not None:
        estimate = overhead(best) * (min(r.first_step_s for r in runs) + tokens / rate)
    online = {r.name: r.time_to_target_s for r in runs if not r.name.startswith("fixed")}
    return CallRow(name, best, rate, estimate, measured_here, online)


def format_row(row: CallRow) -> str:
    best = (
        f"{row.best.name} {row.best.time_to_target_s:.1f} s x{overhead(row.best):.3f}"
        if row.best
        else "no fixed run reached"
    )
    rate = "-" if row.rate is None else f"{row.rate / 1e3:.0f}k"
    estimate = "measured" if row.measured else "-" if row.estimate is None else f"{row.estimate:.1f} s"
    ratios = row.ratios()
    parts = [
        f"{name} {ratios[name][0]:.2f} / {ratios[name][1]:.2f}" if name in ratios
        else f"{name} not reached" if seconds is None else f"{name} {seconds:.1f} s"
        for name, seconds in row.online.items()
    ]  # fmt: skip
    return f"{row.call:<10} {best:<29} {rate:>8} {estimate:>10}   {', '.join(parts)}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("work_dirs", nargs="+", type=Path, help="time_to_target.py --work-dir folders")
    parser.add_argument("--gbs", type=int, required=True, help="the fixed run to estimate where missing")
    parser.add_argument("--tokens", type=float, required=True, help="tokens it needed where it was measured")
    parser.add_argument("--target-ppl", type=float, required=True)
    parser.add_argument(
        "--mean-of", default="online,online-again", help="the online runs the last line averages (names)"
    )
    args = parser.parse_args(argv)
    averaged = args.mean_of.split(",")
    pooled: list[tuple[float, float]] = []
    print(
        f"{'call':<10} {'best fixed measured, overhead':<29} {'rate':>8} {'estimate':>10}   "
        f"online over the measured best / over the better of it and the estimate"
    )
    for work in args.work_dirs:
        runs = [run_numbers(name, records, args.target_ppl) for name, records in measured_runs(work)]
        row = call_row(work.name, runs, args.gbs, args.tokens)
        print(format_row(row))
        pooled += [pair for name, pair in row.ratios().items() if name in averaged]
    if pooled:
        over_best, over_better = (sum(values) / len(pooled) for values in zip(*pooled, strict=True))
        print(f"mean over {len(pooled)} runs ({args.mean_of}): {over_best:.3f} / {over_better:.3f}")


if __name__ == "__main__":
    main()
