"""The policy's probes: when a paired probe of a candidate is worth its cost, and what its outcome decides.

Where the candidate keeps the layout (an in-place switch) and ``training.probe`` is on, the noise scale and
the performance model no longer decide the switch: they are the prior. The performance model names the
candidate (:func:`cona.planner.policy.next_frontier`) and bounds what it can save: were its tokens worth
the current batch's, the candidate would save ``(1 - measured / hoped) x remaining`` seconds, ``hoped`` its
predicted rate raised by as much as the model under-predicted the running strategy (:func:`hoped_rate`). A
probe is made where that bound pays for the probe (the losing branch's time, ``probe_tokens`` at the slower
rate) and the in-place switch with the hysteresis margin. After a probe the candidate lost, it is probed again
once the run's tokens or its noise scale have grown :data:`PROBE_SPACING`-fold: the critical batch grows as
training goes on, at a pace the noise scale tracks even where it misreads the critical batch's size. The
probe's own measurement (:mod:`cona.planner.probe_rule`) then decides: the run continues from the branch
that won.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from cona.planner.policy_types import Candidate, Measurement, PolicySettings, PolicyState, ProbedAt
from cona.planner.probe_rule import ProbeOutcome

PROBE_SPACING = 2.0
"""Growth of the run's tokens, or of the noise scale, since a candidate's lost probe before it is probed
again. The critical batch grows with the tokens trained (about as tokens^0.4: Bergsma et al. 2025), so a
doubling moves it by ~1.3x; and the probes of one candidate cost a geometric series, at most twice the
tokens of its last probe."""


def hoped_rate(state: PolicyState, candidate: Candidate, measured: float) -> float:
    """The candidate's rate as high as the model's error allows (tokens/s): its prediction times the factor
    by which the model under-predicted the running strategy (measured over predicted when it was chosen;
    1 where the model met or overshot it), never above perfect scaling (the measured rate times the gbs
    ratio: a layout-keeping candidate's step at ``k`` times the batch takes no less time than the current's).
    A bound, where the prediction alone is not one: on a host the model does not describe (a CPU running
    gloo) a fitted prediction can under-read a doubled micro-batch's rate by 1.5x, and without the widening
    the probe that would measure it is never made."""
    running = state.current.predicted_tokens_per_s
    missed = measured / running if running > 0 and measured > running else 1.0
    perfect = measured * candidate.strategy.gbs / state.current.strategy.gbs
    return min(candidate.predicted_tokens_per_s * missed, max(perfect, candidate.predicted_tokens_per_s))


def probe_plan(
    state: PolicyState,
    candidate: Candidate,
    measurement: Measurement,
    *,
    remaining_s: float,
    noise: float | None,
    switch_cost_s: float,
    settings: PolicySettings,
    record: dict[str, Any],
) -> tuple[bool, str]:
    """Whether to probe ``candidate`` now, and the words with the numbers that decided it."""
    measured = measurement.measured_tokens_per_s or 0.0
    predicted = candidate.predicted_tokens_per_s
    hoped = hoped_rate(state, candidate, measured) if measured > 0 else predicted
    bound_s = max(1.0 - measured / hoped, 0.0) * remaining_s if hoped > 0 else 0.0
    probe_s = settings.probe_tokens / max(min(measured, predicted), 1e-9)
    cost_s = (probe_s + switch_cost_s) * (1.0 + settings.hysteresis)
    record["probe_plan"] = {
        "hoped_tokens_per_s": hoped, "bound_saved_s": bound_s, "probe_s": probe_s, "cost_s": cost_s,
    }  # fmt: skip
    gbs = candidate.strategy.gbs
    widened = f" (up to {hoped / measured:.3f}x with the model's miss on the running strategy)"
    numbers = (
        f"gbs {gbs} predicted at {predicted / measured:.3f}x the current tokens/s"
        f"{widened if hoped > predicted * 1.0005 else ''}: at equal token value it would save up to "
        f"{bound_s:.1f} s of the remaining {remaining_s:.1f} s"
    )
    if bound_s <= cost_s:
        return False, f"{numbers}, not more than the probe and switch ({cost_s:.1f} s with the margin)"
    last = next((probed for probed in state.probed if probed.gbs == gbs), None)
    if last is not None:
        tokens_due = last.consumed_tokens * PROBE_SPACING
        noise_due = None if last.noise_scale is None else last.noise_scale * PROBE_SPACING
        record["probe_plan"].update(last_probe_tokens=last.consumed_tokens, next_probe_tokens=tokens_due)
        grown = measurement.consumed_tokens >= tokens_due or (
            noise is not None and noise_due is not None and noise >= noise_due
        )
        if not grown:
            return False, (
                f"{numbers}; it lost its probe at {last.consumed_tokens:,} tokens: probed again at "
                f"{tokens_due:,.0f} tokens or a noise scale of {noise_due or float('nan'):.4g}"
            )
    return True, f"{numbers}, more than the probe and switch ({cost_s:.1f} s with the margin): probing"


def probe_target(candidate: Candidate, outcome: ProbeOutcome) -> Candidate:
    """The candidate at the rate its probe branch measured (its tokens over its steady seconds)."""
    rate = outcome.tokens / outcome.candidate.steady_seconds
    return dataclasses.replace(candidate, predicted_tokens_per_s=rate, throughput_source="probed")


def after_lost_probe(
    state: PolicyState, outcome: ProbeOutcome, tokens: int, noise: float | None
) -> PolicyState:
    """Remember where the candidate lost, for :data:`PROBE_SPACING` (the latest probe of each gbs)."""
    kept = tuple(probed for probed in state.probed if probed.gbs != outcome.candidate.gbs)
    lost = ProbedAt(gbs=outcome.candidate.gbs, consumed_tokens=tokens, noise_scale=noise)
    return dataclasses.replace(state, probed=(*kept, lost))


def outcome_record(outcome: ProbeOutcome) -> dict[str, Any]:
    """The probe's numbers as a decision line shows them."""
    return {
        "winner": outcome.winner,
        "samples": outcome.samples,
        "start_loss": outcome.start_loss,
        "current_loss": outcome.current.loss,
        "candidate_loss": outcome.candidate.loss,
        "loss_difference": outcome.loss_difference,
        "tolerance": outcome.tolerance,
        "current_steady_s": outcome.current.steady_seconds,
        "candidate_steady_s": outcome.candidate.steady_seconds,
        "speedup": outcome.speedup,
        "wall_s": outcome.wall_s,
    }
