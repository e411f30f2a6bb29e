"""How much faster than the best fixed run a chain could be, on a time-to-target comparison's own runs.

From the run directories of one seed of a comparison, for each run: its time to the target from its first
step, the tokens it needed, the time of its first step (the compile or warm-up: the first metrics line's
interval less its other steps at the stage's steady rate), and the steady rate of each strategy it trained
under (the median of a stage's lines after its first). No chain reaches the target sooner than the quickest
first step plus the fewest tokens any run needed at the fastest rate any strategy ran, so

    headroom = best fixed time / (quickest first step + fewest tokens / fastest rate)

It is optimistic, not a strict bound: a chain could need fewer tokens than every run here did. Where it is
below the speed-up a claim asks for, the setting cannot show the claim, whatever the policy decides.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .report import first_at_or_below, measured_runs, step_start, strategy_label


@dataclass(frozen=True)
class RunNumbers:
    name: str
    time_to_target_s: float | None
    """From the first step's start to the line whose evaluation reached the target (None: not reached)."""
    tokens_to_target: int | None
    first_step_s: float
    rates: dict[str, float]
    """Steady tokens/s per strategy (``dp1/tp1/pp1 gbs16/mbs16``)."""


def stage_rates(records: list[dict[str, Any]]) -> dict[str, float]:
    """The median tokens/s of each stage's lines after its first, the best stage per strategy."""
    stages: dict[Any, list[dict[str, Any]]] = {}
    for record in records:
        stages.setdefault(record.get("stage"), []).append(record)
    rates: dict[str, float] = {}
    for lines in stages.values():
        if len(lines) < 2:
            continue
        label = strategy_label(lines[0])
        rate = statistics.median(float(line["tokens_per_s"]) for line in lines[1:])
        rates[label] = max(rate, rates.get(label, 0.0))
    return rates


def run_numbers(name: str, records: list[dict[str, Any]], target_ppl: float) -> RunNumbers | None:
    """One run's numbers from its metrics records (None: it logged no training line)."""
    records = [r for r in records if "time" in r and "step_time_s" in r]
    if not records:
        return None
    first = records[0]
    start = step_start(first)
    rates = stage_rates(records)
    label = strategy_label(first)
    # A first stage of one line has no steady rate: its own line's then (the first step counts as steady).
    rate = rates.get(label, float(first["tokens_per_s"]))
    steady_step_s = first["gbs"] * (first["consumed_tokens"] / first["consumed_samples"]) / rate
    first_step_s = float(first["time"]) - start - (int(first.get("steps_in_interval", 1)) - 1) * steady_step_s
    hit = first_at_or_below(records, target_ppl)
    return RunNumbers(
        name=name,
        time_to_target_s=None if hit is None else float(hit["time"]) - start,
        tokens_to_target=None if hit is None else int(hit["consumed_tokens"]),
        first_step_s=first_step_s,
        rates=rates,
    )


def headroom(runs: list[RunNumbers]) -> dict[str, Any]:
    """The best fixed run (names starting ``fixed``), the optimistic chain and their ratio."""
    fixed = [r for r in runs if r.name.startswith("fixed") and r.time_to_target_s is not None]
    reached = [r for r in runs if r.tokens_to_target is not None]
    if not fixed or not reached:
        raise SystemExit("no fixed run reached the target: nothing to compare with")
    best = min(fixed, key=lambda r: r.time_to_target_s)
    fewest = min(r.tokens_to_target for r in reached)
    fastest_label, fastest = max(
        ((label, rate) for r in runs for label, rate in r.rates.items()), key=lambda pair: pair[1]
    )
    quickest_start = min(r.first_step_s for r in runs)
    chain_s = quickest_start + fewest / fastest
    return {
        "best_fixed": best.name,
        "best_fixed_s": best.time_to_target_s,
        "fewest_tokens": fewest,
        "fastest": fastest_label,
        "fastest_tokens_per_s": fastest,
        "quickest_first_step_s": quickest_start,
        "chain_s": chain_s,
        "headroom": best.time_to_target_s / chain_s,
    }


def after_first_step(runs: list[RunNumbers]) -> dict[str, float]:
    """Each run's time to the target after its first step, over the best fixed run's by the same measure:
    a policy comparison free of the first step (a compile whose time scatters by seconds between runs), not
    the claim's time, which counts the compile."""
    after = {r.name: r.time_to_target_s - r.first_step_s for r in runs if r.time_to_target_s is not None}
    fixed = [after[name] for name in after if name.startswith("fixed")]
    if not fixed:
        return {}
    return {name: seconds / min(fixed) for name, seconds in after.items() if not name.startswith("fixed")}


def work_dir_headroom(work_dir: Path, target_ppl: float) -> dict[str, Any] | None:
    """The headroom of one seed's folder (None: no fixed run reached the target yet), with each run's
    time after its first step over the best fixed run's (``after_first_step``)."""
    runs = [run_numbers(name, records, target_ppl) for name, records in measured_runs(work_dir)]
    runs = [run for run in runs if run is not None]
    fixed = [r for r in runs if r.name.startswith("fixed") and r.time_to_target_s is not None]
    if not fixed:
        return None
    return {**headroom(runs), "after_first_step": after_first_step(runs)}


def format_headroom(seed: int | str, result: dict[str, Any]) -> str:
    rate, start = result["fastest_tokens_per_s"], result["quickest_first_step_s"]
    listed = ", ".join(f"{name} {ratio:.2f}" for name, ratio in result["after_first_step"].items()) or "-"
    return (
        f"seed {seed}: best fixed {result['best_fixed']} {result['best_fixed_s']:.1f} s; a chain needing "
        f"{result['fewest_tokens']:,} tokens at {result['fastest']}'s {rate:,.0f} tokens/s "
        f"after a {start:.1f} s first step: {result['chain_s']:.1f} s, at most {result['headroom']:.2f}x "
        f"faster; after the first step, over the best fixed run after its own: {listed}"
    )
