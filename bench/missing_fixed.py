"""An estimate of a fixed run a comparison did not make, from the rate its host ran that batch at.

Most time-to-target calls ran only fixed gbs 32 beside online (to save device time); whether fixed gbs 16
would have been faster on the same host was left open. The training is deterministic enough that a fixed
run needs about the same tokens on every host (fixed gbs 16: 14.16M to ppl 20 in several calls), while the
hosts' eager rates differ by up to 1.5x. So, per call: the host's steady rate at that batch (the fastest
median over any run's stages at it, ``ttt_headroom.stage_rates``: online runs train there too), the
tokens given with ``--tokens`` (from a call that ran it), and the call's quickest first step give

    estimated time = overhead x (quickest first step + tokens / rate)

where ``overhead`` is the call's measured best fixed run's time over the same sum of its own (the
evaluations and the lines' time outside the steady rate: 1.04-1.07 in e21-e41; in e38, which ran both,
1.038 at gbs 16 and 1.040 at gbs 32). Each online run's time from its first step is then printed over the
measured best fixed run and over the better of it and the estimate. An estimate, not a measurement: a
run's one-line stage is no steady rate (left out), and a fixed run's evaluation could cross the target a
line earlier or later. Checked on e38 (H100), which ran fixed gbs 16: estimated from fixed gbs 32 and the
gbs-16 rate of another run of the call, 57.2 s; measured 57.5 s.

    python3 bench/missing_fixed.py --gbs 16 --tokens 14.16e6 --target-ppl 20 WORK...
"""

from __future__ import annotations

import argparse
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


def call_row(name: str, runs: list[RunNumbers], gbs: int, tokens: float) -> dict[str, object]:
    """One call: the measured best fixed run, the estimate at ``gbs`` and each online run's two ratios."""
    fixed = [r for r in runs if r.name.startswith("fixed") and r.time_to_target_s is not None]
    best = min(fixed, key=lambda r: r.time_to_target_s) if fixed else None
    measured_here = any(r.name == f"fixed-gbs{gbs}" for r in runs)
    rate = host_rate(runs, gbs)
    estimate = None
    if rate is not None and not measured_here and best is not None:
        estimate = overhead(best) * (min(r.first_step_s for r in runs) + tokens / rate)
    online = {r.name: r.time_to_target_s for r in runs if not r.name.startswith("fixed")}
    return {
        "call": name,
        "best": best,
        "rate": rate,
        "estimate": estimate,
        "measured": measured_here,
        "online": online,
    }


def format_row(row: dict[str, object]) -> str:
    best: RunNumbers | None = row["best"]  # type: ignore[assignment]
    estimate: float | None = row["estimate"]  # type: ignore[assignment]
    rate: float | None = row["rate"]  # type: ignore[assignment]
    shown_best = f"{best.name} {best.time_to_target_s:.1f} s" if best else "no fixed run reached"
    shown_rate = "-" if rate is None else f"{rate / 1e3:.0f}k"
    shown_estimate = "measured" if row["measured"] else "-" if estimate is None else f"{estimate:.1f} s"
    parts = []
    for name, seconds in row["online"].items():  # type: ignore[union-attr]
        if seconds is None or best is None:
            parts.append(f"{name} not reached" if seconds is None else f"{name} {seconds:.1f} s")
            continue
        against = min(best.time_to_target_s, estimate) if estimate is not None else best.time_to_target_s
        parts.append(f"{name} {seconds / best.time_to_target_s:.2f} / {seconds / against:.2f}")
    return f"{row['call']:<10} {shown_best:<22} {shown_rate:>8} {shown_estimate:>10}   {', '.join(parts)}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("work_dirs", nargs="+", type=Path, help="time_to_target.py --work-dir folders")
    parser.add_argument("--gbs", type=int, required=True, help="the fixed run to estimate where missing")
    parser.add_argument("--tokens", type=float, required=True, help="tokens it needed where it was measured")
    parser.add_argument("--target-ppl", type=float, required=True)
    args = parser.parse_args(argv)
    print(
        f"{'call':<10} {'best fixed measured':<22} {'rate':>8} {'estimate':>10}   "
        f"online over the measured best / over the better of it and the estimate"
    )
    for work in args.work_dirs:
        runs = [run_numbers(name, records, args.target_ppl) for name, records in measured_runs(work)]
        print(format_row(call_row(work.name, runs, args.gbs, args.tokens)))


if __name__ == "__main__":
    main()
