"""The policy's in-place trials: when a candidate the model says loses is still tried, measured, in place.

A trial is made where the best throughput the candidate could have would pay for the switch there and back:
perfect scaling from the measured rate, or, for a throughput model fitted on one or more measured
strategies, its prediction plus the margin it may miss by (:attr:`PolicySettings.trial_prediction_error`, or
the largest miss the run has measured). :mod:`cona.planner.policy` judges the trial once it is measured.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from cona.planner.efficiency import progress_per_second
from cona.planner.policy_types import Candidate, Measurement, PolicySettings, PolicyState

MIN_FITTED_ON = 1
"""Measured strategies a prediction must rest on before its margin, not perfect scaling, bounds a trial. One
is enough: the one-point fit keeps the model's shape where the step is host-bound, and predicts a doubled
batch within about 4% (measured over predicted 0.96-1.03, eager and compiled), while a trial on perfect
scaling from one point falls back after a line or two that cost the run's early time. The raw model's
predictions (0.74-1.08 of the measured rate) keep perfect scaling."""


def prediction_miss(candidate: Candidate, measured_tokens_per_s: float | None) -> float:
    """``|measured / predicted - 1|`` of a strategy switched to on a prediction fitted on one or more
    measured strategies; 0 for any other (measured, or the raw model's)."""
    fitted = candidate.throughput_source == "predicted" and candidate.fitted_on >= MIN_FITTED_ON
    if not fitted or not measured_tokens_per_s or candidate.predicted_tokens_per_s <= 0:
        return 0.0
    return abs(measured_tokens_per_s / candidate.predicted_tokens_per_s - 1.0)


def warming_up(current: Candidate, measurement: Measurement, settings: PolicySettings) -> bool:
    """Whether a trial's one measured line is so far below its fitted prediction (beyond the trial margin)
    that it may still hold the new shape's warm-up: then it is measured once more before it is judged.
    Compiled, a new shape's graphs can warm up past the stage's first line: the trial's first measured line
    can run at 0.4 of the prediction while the next meets it, and judged on the first the trial would fall
    back for no reason."""
    measured = measurement.measured_tokens_per_s
    fitted = current.fitted_on >= MIN_FITTED_ON
    if not current.trial or not fitted or measurement.measured_intervals != 1 or not measured:
        return False
    return measured * (1.0 + settings.trial_prediction_error) < current.predicted_tokens_per_s


def trial_candidate(
    state: PolicyState,
    candidate: Candidate,
    current_progress: float,
    remaining_s: float,
    noise: float,
    settings: PolicySettings,
    record: dict[str, Any],
) -> Candidate | None:
    """The candidate as an in-place trial when it keeps the layout, its throughput is only predicted, and the
    best throughput it could have (:func:`_best_case_tokens_per_s`) would pay for the trial and for the way
    back."""
    measured = record["current"]["measured_tokens_per_s"]
    if not (settings.trial_in_place and record["in_place"] and candidate.throughput_source == "predicted"):
        return None
    if not measured:
        return None
    best_rate, why = _best_case_tokens_per_s(state, candidate, measured, settings)
    best_case = float(progress_per_second(best_rate, candidate.strategy.gbs, noise, settings.base_gbs))
    saved_s = max(1.0 - current_progress / best_case, 0.0) * remaining_s
    cost_s = 2 * record["switch_cost_s"] * (1.0 + settings.hysteresis)  # there and, if it fails, back
    record.update(trial_best_case_tokens_per_s=best_rate, trial_best_case_saved_s=saved_s)
    if saved_s <= cost_s:
        return None
    record["trial"] = (
        f"trial in place: {why} would save up to {saved_s:.1f} s, more than {cost_s:.1f} s for "
        "the switch there and back; measured, it is left again if it does not pay"
    )
    return dataclasses.replace(candidate, trial=True)


def _best_case_tokens_per_s(
    state: PolicyState, candidate: Candidate, measured: float, settings: PolicySettings
) -> tuple[float, str]:
    """The most a trial candidate could run at, and the words for it. Perfect scaling from the current
    measured rate bounds any batch's; a model fitted on a measured strategy bounds it further by its
    prediction plus the margin it may miss by (the setting, or the largest miss this run has seen)."""
    perfect = measured * candidate.strategy.gbs / state.current.strategy.gbs
    if candidate.fitted_on < MIN_FITTED_ON:
        return perfect, "perfect scaling"
    current_miss = prediction_miss(state.current, measured)
    margin = max(settings.trial_prediction_error, state.largest_prediction_miss, current_miss)
    bounded = candidate.predicted_tokens_per_s * (1.0 + margin)
    if bounded >= perfect:
        return perfect, "perfect scaling"
    return bounded, f"{margin:.0%} above its prediction"
