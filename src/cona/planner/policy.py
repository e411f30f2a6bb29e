"""The online switching policy: when to move to the next global batch size, and when to fall back (pure).

Progress is counted in base-batch-equivalent tokens (``training.base_gbs`` = ``M0``): a token trained at
global batch ``M`` is worth the statistical efficiency ``(phi + M0) / (phi + M)`` of one at ``M0``
(:mod:`cona.planner.efficiency`), so progress per second = tokens/s x efficiency. Every evaluation compares

* the current strategy: its *measured* tokens/s x its efficiency at the current noise scale, with
* the frontier candidate (the best strategy at the next larger gbs): its *predicted* tokens/s (calibrated
  performance model) x its efficiency,

and switches only when the time the candidate saves over the rest of training beats the switch cost with a
margin: ``(1 - progress_now / progress_candidate) x remaining_s > switch_cost_s x (1 + hysteresis)``. The
first factor is the fraction of every remaining second the candidate saves ("gain per second"). The noise
scale used is today's; it normally grows as the loss falls, so the estimate of the saving is conservative.

A switch is never made on an unknown noise scale (the tracker's ``|G|^2`` average <= 0, or fewer than
``min_measurements`` measurements): with no noise information the efficiency of a larger batch is unknowable,
and AdaptDL's habit of reading that as an infinite noise scale jumps to the largest batch exactly when the
estimate is worst. Before the run has measured any throughput (its first line holds the start-up), the
current strategy's rate is the estimator's prediction (``Measurement.rate_measured`` False), and no switch is
made on it; a probe, which measures both rates itself, may be.

A candidate that keeps the layout, where the run switches in place and ``probe`` is on, is decided by a
paired probe instead (:mod:`cona.planner.policy_probe`): the rule above is then its prior, logged beside it.

With ``fallback`` on, an exponential moving average of the noise scale is compared with the noise scale at
which the previous (smaller) gbs and the current one make equal progress per second (both measured). When the
average stays below that break-even point for ``fallback_patience`` consecutive evaluations, the policy falls
back to the previous strategy.

Everything here is a pure function over frozen dataclasses: the runner's search thread and the offline
simulator (:mod:`cona.planner.plan`) call the same code.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from cona.planner.efficiency import NoiseScaleEstimate, statistical_efficiency
from cona.planner.policy_probe import after_lost_probe, outcome_record, probe_plan, probe_target
from cona.planner.policy_types import (  # the policy's data, re-exported: callers import it from here
    DEFAULT_HYSTERESIS,
    Action,
    Candidate,
    Decision,
    FinishedStage,
    Measurement,
    PolicySettings,
    PolicyState,
)
from cona.strategy import Strategy

__all__ = [
    "DEFAULT_HYSTERESIS", "Action", "Candidate", "Decision", "FinishedStage", "Measurement", "PolicySettings",
    "PolicyState", "after_switch", "break_even_noise_scale", "decide", "initial_state", "next_frontier",
    "next_gbs", "progress_per_second", "refresh_predicted_rates", "strategy_dict",
    "switch_cost_s", "switches_in_place",
]  # fmt: skip


ENDING_INTERVALS = 2
"""No switch or fall-back with this many evaluations' worth of tokens or fewer left: the workers, which
train on while the runner decides, may reach the end first (the demo once recorded a switch that never
happened), and a stage shorter than an evaluation interval is never measured."""


def next_gbs(current_gbs: int, settings: PolicySettings) -> int | None:
    """The frontier: the next larger gbs to search, or None when ``max_gbs`` is reached."""
    if settings.gbs_list is not None:
        larger = [g for g in settings.gbs_list if current_gbs < g <= settings.max_gbs]
        return min(larger) if larger else None
    if current_gbs >= settings.max_gbs:
        return None
    return min(current_gbs * settings.gbs_factor, settings.max_gbs)


def next_frontier(
    current_gbs: int,
    measured_tokens_per_s: float,
    settings: PolicySettings,
    best_at: Callable[[int], Candidate | None],
) -> Candidate | None:
    """The first frontier candidate (the best strategy of the next gbs, then of the one after, ...) that can
    ever win: one no faster in tokens/s than the current strategy never does, since every efficiency tends
    to 1 as the noise scale grows. ``best_at(gbs)`` is the search (None when nothing fits at that gbs).

    Without this, one frontier whose best strategy is slow (a search that stopped early, a gbs the layout
    suits badly) would hold training at the current gbs for good.
    """
    gbs = next_gbs(current_gbs, settings)
    while gbs is not None:
        candidate = best_at(gbs)
        if candidate is not None and candidate.predicted_tokens_per_s > measured_tokens_per_s:
            return candidate
        gbs = next_gbs(gbs, settings)
    return None


def initial_state(current: Candidate) -> PolicyState:
    return PolicyState(current=current)


def after_switch(
    state: PolicyState,
    *,
    new: Candidate,
    old_measured_tokens_per_s: float,
    switch_cost_s: float | None,
    in_place: bool = False,
    old_rate_measured: bool = True,
) -> PolicyState:
    """The state once the runner has carried out a switch (or fallback) to ``new``.

    ``switch_cost_s`` is the measured time the switch took (None if it could not be measured); the mean of
    the measured costs (of in-place switches apart) replaces the predicted one in later decisions.
    ``old_rate_measured``: False when the stage left had no steady line (its rate is the estimator's).
    """
    if new.strategy.gbs < state.current.strategy.gbs:
        earlier = state.earlier[:-1] if state.earlier else ()
    else:
        finished = FinishedStage(
            strategy=state.current.strategy,
            measured_tokens_per_s=old_measured_tokens_per_s,
            rate_measured=old_rate_measured,
        )
        earlier = (*state.earlier, finished)
    state = dataclasses.replace(state, current=new, earlier=earlier, below_break_even=0)
    if switch_cost_s is None:
        return state
    if in_place:
        cost, count = _mean_with(state.measured_in_place_cost_s, state.in_place_switches, switch_cost_s)
        return dataclasses.replace(state, measured_in_place_cost_s=cost, in_place_switches=count)
    cost, count = _mean_with(state.measured_switch_cost_s, state.switches, switch_cost_s)
    return dataclasses.replace(state, measured_switch_cost_s=cost, switches=count)


def refresh_predicted_rates(state: PolicyState, predict: Callable[[Strategy], float]) -> PolicyState:
    """Earlier stages the run left before measuring them take ``predict``'s rate (the estimator's, refitted
    on what the run has measured since), so a fall-back to one is judged on the best estimate there is."""
    earlier = tuple(
        stage
        if stage.rate_measured
        else dataclasses.replace(stage, measured_tokens_per_s=predict(stage.strategy))
        for stage in state.earlier
    )
    return dataclasses.replace(state, earlier=earlier)


def _mean_with(mean: float | None, count: int, value: float) -> tuple[float, int]:
    return (value if mean is None else (mean * count + value) / (count + 1)), count + 1


def switches_in_place(current: Strategy, target: Strategy, settings: PolicySettings) -> bool:
    """Whether a switch from ``current`` to ``target`` is carried out in place."""
    return settings.in_place and current.same_layout(target, keep_mbs=not settings.in_place_mbs)


def progress_per_second(tokens_per_s: float, gbs: int, noise_scale: float, base_gbs: int) -> float:
    """Base-batch-equivalent tokens per second."""
    return tokens_per_s * float(statistical_efficiency(gbs, noise_scale, base_gbs))


def break_even_noise_scale(small: FinishedStage, current_gbs: int, current_tokens_per_s: float) -> float:
    """Noise scale at which the smaller-gbs stage and the current one make equal progress per second.

    Solving ``T_c / (phi + M_c) = T_s / (phi + M_s)`` for ``phi``. Infinite when the larger batch is not even
    faster in tokens/s (it never pays, whatever the noise).
    """
    t_small, m_small = small.measured_tokens_per_s, small.strategy.gbs
    if current_tokens_per_s <= t_small:
        return math.inf
    return max(
        (t_small * current_gbs - current_tokens_per_s * m_small) / (current_tokens_per_s - t_small), 0.0
    )


def decide(
    state: PolicyState, measurement: Measurement, candidate: Candidate | None, settings: PolicySettings
) -> Decision:
    """One evaluation: stay, switch to ``candidate`` (the frontier, e.g. from :func:`next_frontier`; None
    when there is none) or fall back to the previous stage's strategy."""
    noise = _usable_noise_scale(measurement.noise, settings)
    record = _record_base(state, measurement, settings)
    measured = measurement.measured_tokens_per_s
    if measurement.probe is not None and state.probing is not None:
        return _after_probe(state, measurement, noise, record)
    if noise is None or measured is None or measured <= 0:
        return _decision("stay", None, _unknown_reason(measurement, settings), record, state)
    current = state.current.strategy
    current_progress = progress_per_second(measured, current.gbs, noise, settings.base_gbs)
    remaining_s = measurement.remaining_tokens / measured
    record["current"].update(
        efficiency=_efficiency(current.gbs, noise, settings), progress_per_s=current_progress
    )
    record["remaining_s"] = remaining_s
    state = _with_ema(state, noise, settings)
    record["noise_scale_ema"] = state.noise_ema
    if measurement.remaining_tokens <= ENDING_INTERVALS * measurement.interval_tokens:
        # The workers would reach the end before (or just after) the handover: a switch decided now would
        # not happen, or not run long enough to be measured.
        left = measurement.remaining_tokens
        why = f"training ends within {ENDING_INTERVALS} evaluations ({left:,.0f} tokens left): no switch"
        return _decision("stay", None, why, record, state)
    state, fallback = _fallback_check(state, measured, settings, record)
    if fallback is not None:
        return fallback
    if candidate is None:
        return _decision("stay", None, f"no frontier beyond gbs {current.gbs} can win", record, state)
    if settings.probe and switches_in_place(current, candidate.strategy, settings):
        return _probe_or_stay(
            state, measurement, candidate, current_progress, remaining_s, noise, settings, record
        )
    return _compare(state, candidate, current_progress, remaining_s, noise, settings, record)


def _probe_or_stay(
    state: PolicyState,
    measurement: Measurement,
    candidate: Candidate,
    current_progress: float,
    remaining_s: float,
    noise: float,
    settings: PolicySettings,
    record: dict[str, Any],
) -> Decision:
    """A layout-keeping candidate: probed where the prior says a probe is worth its cost, else stay. The
    noise-scale model's view of the candidate is logged (``candidate.progress_per_s``), not acted on."""
    _candidate_record(candidate, noise, settings, record)
    prior = record["candidate"]["progress_per_s"] / current_progress
    cost_s, source = switch_cost_s(state, settings, in_place=True)
    record.update(switch_cost_s=cost_s, switch_cost_source=source, in_place=True, prior_progress_ratio=prior)
    probing, why = probe_plan(
        state, candidate, measurement, remaining_s=remaining_s, noise=noise, switch_cost_s=cost_s,
        settings=settings, record=record,
    )  # fmt: skip
    why = f"{why} (the noise-scale model puts its progress per second at {prior:.3f}x the current's)"
    if not probing:
        return _decision("stay", None, why, record, state)
    record["probe_request"] = {"tokens": settings.probe_tokens, "tolerance": settings.probe_tolerance}
    return _decision("probe", candidate, why, record, dataclasses.replace(state, probing=candidate))


def _after_probe(
    state: PolicyState, measurement: Measurement, noise: float | None, record: dict[str, Any]
) -> Decision:
    """The probe's outcome decides: a won probe is a switch the workers already made (the run goes on from
    the candidate's branch), a lost one a stay, remembered for the next probe of that gbs."""
    outcome, candidate = measurement.probe, state.probing
    assert outcome is not None and candidate is not None
    record["probe"] = outcome_record(outcome)
    record["in_place"] = True
    state = dataclasses.replace(state, probing=None)
    why = f"probe of gbs {outcome.candidate.gbs}: {outcome.reason}"
    if outcome.winner == "candidate":
        target = probe_target(candidate, outcome)
        record["candidate"] = {
            "strategy": strategy_dict(target.strategy),
            "predicted_tokens_per_s": target.predicted_tokens_per_s,
            "throughput_source": target.throughput_source,
        }
        return _decision("switch", target, why, record, state)
    state = after_lost_probe(state, outcome, measurement.consumed_tokens, noise)
    return _decision("stay", None, why, record, state)


def _candidate_record(
    candidate: Candidate, noise: float, settings: PolicySettings, record: dict[str, Any]
) -> float:
    """The candidate's part of the decision line; returns its progress per second under the noise model."""
    gbs = candidate.strategy.gbs
    candidate_progress = progress_per_second(candidate.predicted_tokens_per_s, gbs, noise, settings.base_gbs)
    record["candidate"] = {
        "strategy": strategy_dict(candidate.strategy),
        "predicted_tokens_per_s": candidate.predicted_tokens_per_s,
        "throughput_source": candidate.throughput_source,
        "fitted_on": candidate.fitted_on,
        "on_first_line": candidate.on_first_line,
        "efficiency": _efficiency(gbs, noise, settings),
        "progress_per_s": candidate_progress,
    }
    return candidate_progress


def _compare(
    state: PolicyState,
    candidate: Candidate,
    current_progress: float,
    remaining_s: float,
    noise: float,
    settings: PolicySettings,
    record: dict[str, Any],
) -> Decision:
    """The switch rule: the time the candidate saves over the remaining training against the switch cost."""
    candidate_progress = _candidate_record(candidate, noise, settings, record)
    saved_s = max(1.0 - current_progress / candidate_progress, 0.0) * remaining_s
    in_place = switches_in_place(state.current.strategy, candidate.strategy, settings)
    cost_s, source = switch_cost_s(state, settings, in_place=in_place)
    record.update(switch_cost_s=cost_s, switch_cost_source=source, in_place=in_place)
    record["time_saved_s"] = saved_s
    ratio = f"candidate makes {candidate_progress / current_progress:.3f}x the progress per second"
    margin = f"the switch cost {cost_s:.1f} s x {1 + settings.hysteresis:g}"
    pays = saved_s > cost_s * (1.0 + settings.hysteresis) and candidate_progress > current_progress
    if pays and record["current"]["rate_measured"]:
        why = f"{ratio}; saves {saved_s:.1f} s over the remaining {remaining_s:.1f} s, more than {margin}"
        return _decision("switch", candidate, why, record, state)
    if pays:
        why = f"{ratio}, but the current rate is only predicted: a switch waits for its first measured line"
        return _decision("stay", None, why, record, state)
    why = (
        f"{ratio}; would save {saved_s:.1f} s over the remaining {remaining_s:.1f} s, not more than {margin}"
    )
    return _decision("stay", None, why, record, state)


def switch_cost_s(
    state: PolicyState, settings: PolicySettings, *, in_place: bool = False
) -> tuple[float, str]:
    """The cost to charge a switch (in place or through a checkpoint), and whether it was measured or
    predicted."""
    if in_place:
        if state.measured_in_place_cost_s is not None:
            return state.measured_in_place_cost_s, "measured"
        return settings.predicted_in_place_cost_s, "predicted"
    if state.measured_switch_cost_s is not None:
        return state.measured_switch_cost_s, "measured"
    return settings.predicted_switch_cost_s, "predicted"


def strategy_dict(strategy: Strategy) -> dict[str, Any]:
    return {field.name: getattr(strategy, field.name) for field in dataclasses.fields(strategy)}


def _usable_noise_scale(noise: NoiseScaleEstimate | None, settings: PolicySettings) -> float | None:
    if noise is None or noise.samples < settings.min_measurements or noise.noise_scale is None:
        return None
    return noise.noise_scale * settings.noise_scale_factor


def _noise_samples(measurement: Measurement) -> int:
    noise = measurement.noise
    return measurement.noise_measurements if noise is None else noise.samples


def _unknown_reason(measurement: Measurement, settings: PolicySettings) -> str:
    noise = measurement.noise
    if noise is None or noise.samples < settings.min_measurements:
        have = _noise_samples(measurement)
        return f"noise scale unknown: {have} of {settings.min_measurements} measurements needed"
    if noise.noise_scale is None:
        return f"noise scale unknown: the smoothed |G|^2 is {noise.grad_sqr:.3g} (not positive)"
    return "no measured throughput of the current strategy yet"


def _efficiency(gbs: int, noise: float, settings: PolicySettings) -> float:
    return float(statistical_efficiency(gbs, noise, settings.base_gbs))


def _with_ema(state: PolicyState, noise: float, settings: PolicySettings) -> PolicyState:
    alpha = settings.fallback_ema_alpha
    ema = noise if state.noise_ema is None else alpha * noise + (1.0 - alpha) * state.noise_ema
    return dataclasses.replace(state, noise_ema=ema)


def _fallback_check(
    state: PolicyState,
    measured_tokens_per_s: float,
    settings: PolicySettings,
    record: dict[str, Any],
) -> tuple[PolicyState, Decision | None]:
    """Count evaluations with the EMA below the break-even point; a fallback decision after
    ``fallback_patience``."""
    if not settings.fallback or not state.earlier or state.noise_ema is None:
        return state, None
    previous = state.earlier[-1]
    break_even = break_even_noise_scale(previous, state.current.strategy.gbs, measured_tokens_per_s)
    judged = state.noise_ema
    below = state.below_break_even + 1 if judged * (1.0 + settings.hysteresis) < break_even else 0
    # None stands for "never breaks even" (JSON has no infinity); the smaller batch's rate may be predicted.
    record.update(fallback_break_even_noise_scale=break_even if math.isfinite(break_even) else None)
    record.update(below_break_even=below, fallback_previous_rate_measured=previous.rate_measured)
    if below < settings.fallback_patience:
        return dataclasses.replace(state, below_break_even=below), None
    why = (
        f"smoothed noise scale {judged:.4g} below the break-even {break_even:.4g} of gbs "
        f"{previous.strategy.gbs} vs {state.current.strategy.gbs} for {below} evaluations"
    )
    record["fallback_candidate"] = {
        "strategy": strategy_dict(previous.strategy),
        "measured_tokens_per_s": previous.measured_tokens_per_s,
    }
    target = Candidate(
        strategy=previous.strategy,
        predicted_tokens_per_s=previous.measured_tokens_per_s,
        throughput_source="measured" if previous.rate_measured else "predicted",
    )
    record["in_place"] = switches_in_place(state.current.strategy, previous.strategy, settings)
    decision = _decision("fallback", target, why, record, dataclasses.replace(state, below_break_even=0))
    return state, decision


def _record_base(state: PolicyState, measurement: Measurement, settings: PolicySettings) -> dict[str, Any]:
    cost, source = switch_cost_s(state, settings)
    noise = measurement.noise
    measured = measurement.measured_tokens_per_s
    predicted = state.current.predicted_tokens_per_s
    return {
        "time": measurement.time,
        "iteration": measurement.iteration,
        "consumed_tokens": measurement.consumed_tokens,
        "noise_scale": None if noise is None else noise.noise_scale,  # as measured
        "noise_scale_factor": settings.noise_scale_factor,  # the EMA and break-evens: of phi times this
        "noise_samples": _noise_samples(measurement),
        "current": {
            "strategy": strategy_dict(state.current.strategy),
            "measured_tokens_per_s": measured,
            "rate_measured": measurement.rate_measured,
            "efficiency": None,
            "progress_per_s": None,
        },
        "candidate": None,
        "current_predicted_tokens_per_s": predicted,
        "predicted_over_measured": predicted / measured if measured and measurement.rate_measured else None,
        "switch_cost_s": cost,
        "switch_cost_source": source,
        "remaining_s": None,
    }


def _decision(
    action: Action, target: Candidate | None, reason: str, record: dict[str, Any], state: PolicyState
) -> Decision:
    record.update(decision=action, reason=reason)
    return Decision(action=action, target=target, reason=reason, record=record, state=state)
