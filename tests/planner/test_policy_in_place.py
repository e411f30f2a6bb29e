"""The policy's in-place switches and trials, on the synthetic noise scales of
:mod:`tests.planner.policy_cases`."""

import dataclasses

import pytest
from tests.planner.policy_cases import (
    BASE,
    CANDIDATE,
    SETTINGS,
    fresh_state,
    measure,
    tracker_at,
)

from cona.planner.policy import (
    Candidate,
    Measurement,
    PolicySettings,
    after_switch,
    decide,
    initial_state,
    prediction_miss,
    switches_in_place,
)
from cona.strategy import Strategy

ONE_GPU_8 = Strategy(dp=1, tp=1, pp=1, mbs=8, gbs=16)
ONE_GPU_16 = Strategy(dp=1, tp=1, pp=1, mbs=16, gbs=32)
ONE_GPU_32 = Strategy(dp=1, tp=1, pp=1, mbs=32, gbs=64)
IN_PLACE = PolicySettings(base_gbs=BASE, max_gbs=64, in_place=True, predicted_in_place_cost_s=1.0)


def test_a_layout_keeping_candidate_the_model_undersells_is_tried_in_place():
    # Noise scale 20: gbs 32 makes (20 + 16) / (20 + 32) = 0.69 of the progress per sample. Predicted 1.15x
    # the measured rate it does not pay; perfectly scaled (2x, as a host-bound step nearly is) it would.
    state = initial_state(Candidate(strategy=ONE_GPU_8, predicted_tokens_per_s=1000.0))
    candidate = Candidate(strategy=ONE_GPU_16, predicted_tokens_per_s=1150.0)
    measurement = measure(20.0, tokens_per_s=1000.0, remaining=1e5)
    decision = decide(state, measurement, candidate, IN_PLACE)
    assert decision.action == "switch" and decision.target.trial
    assert decision.record["in_place"] and decision.record["switch_cost_s"] == 1.0
    assert "trial in place" in decision.reason
    # Not without in-place switches, nor when its rate was measured (the model's word is not what failed).
    assert decide(state, measurement, candidate, SETTINGS).action == "stay"
    measured = Candidate(strategy=ONE_GPU_16, predicted_tokens_per_s=1150.0, throughput_source="measured")
    assert decide(state, measurement, measured, IN_PLACE).action == "stay"
    no_trials = PolicySettings(base_gbs=BASE, max_gbs=64, in_place=True, trial_in_place=False)
    assert decide(state, measurement, candidate, no_trials).action == "stay"
    # Nor when even perfect scaling could not pay for the way there and back.
    short = measure(20.0, tokens_per_s=1000.0, remaining=2e3)
    assert decide(state, short, candidate, IN_PLACE).action == "stay"


def test_a_candidate_fitted_on_measured_strategies_is_tried_only_where_its_prediction_could_miss_enough():
    """Perfect scaling bounds a trial's hope where the model rests on no measured strategy; once it rests on
    one or more, the prediction plus its margin (15%, or the largest miss the run saw) does."""
    state = initial_state(Candidate(strategy=ONE_GPU_8, predicted_tokens_per_s=1000.0))
    measurement = measure(20.0, tokens_per_s=1000.0, remaining=1e5)
    fitted = Candidate(strategy=ONE_GPU_16, predicted_tokens_per_s=1150.0, fitted_on=2)
    # At noise scale 20, 1150 x 1.15 tokens/s at gbs 32 make 0.92x the progress of 1000 at gbs 16: no trial.
    decision = decide(state, measurement, fitted, IN_PLACE)
    assert decision.action == "stay"
    assert decision.record["trial_best_case_tokens_per_s"] == pytest.approx(1150.0 * 1.15)
    # A wider setting, or a miss this run measured, widens the hope (1150 x 1.3: 1.035x).
    wider = dataclasses.replace(IN_PLACE, trial_prediction_error=0.3)
    assert decide(state, measurement, fitted, wider).target.trial
    missed = dataclasses.replace(state, largest_prediction_miss=0.3)
    tried = decide(missed, measurement, fitted, IN_PLACE)
    assert tried.target.trial and "30% above its prediction" in tried.reason
    # Never above perfect scaling (2000 tokens/s from 1000 at half the batch).
    hopeful = dataclasses.replace(IN_PLACE, trial_prediction_error=5.0)
    assert decide(state, measurement, fitted, hopeful).record["trial_best_case_tokens_per_s"] == 2000.0


def test_leaving_a_fitted_prediction_records_its_miss_and_the_current_one_counts_too():
    fitted = Candidate(strategy=ONE_GPU_16, predicted_tokens_per_s=1150.0, fitted_on=2)
    state = initial_state(Candidate(strategy=ONE_GPU_8, predicted_tokens_per_s=3000.0))  # the raw model
    state = after_switch(state, new=fitted, old_measured_tokens_per_s=1000.0, switch_cost_s=0.1)
    assert state.largest_prediction_miss == 0.0  # the first stage's raw-model prediction is no fit's miss
    assert prediction_miss(fitted, 1000.0) == pytest.approx(0.15 / 1.15)
    assert prediction_miss(dataclasses.replace(fitted, fitted_on=1), 500.0) == pytest.approx(1 - 500 / 1150)
    assert prediction_miss(dataclasses.replace(fitted, fitted_on=0), 500.0) == 0.0  # the raw model's
    onward = Candidate(strategy=ONE_GPU_32, predicted_tokens_per_s=4000.0, fitted_on=2)
    left = after_switch(state, new=onward, old_measured_tokens_per_s=2300.0, switch_cost_s=0.1)
    assert left.largest_prediction_miss == pytest.approx(1.0)  # measured 2x its prediction
    # On the stage it runs: gbs 32 measured at 2000 against 1150 predicted widens the next trial's hope.
    candidate = Candidate(strategy=ONE_GPU_32, predicted_tokens_per_s=2100.0, fitted_on=2)
    decision = decide(state, measure(20.0, tokens_per_s=2000.0, remaining=1e5), candidate, IN_PLACE)
    margin = 2000.0 / 1150.0 - 1.0
    assert decision.record["trial_best_case_tokens_per_s"] == pytest.approx(
        min(2100.0 * (1.0 + margin), 2000.0 * 64 / 32)
    )


def test_a_trial_far_below_its_fitted_prediction_on_one_line_is_measured_once_more():
    """A compiled shape's warm-up can outlast the stage's first line: a trial's one measured line far below
    its fitted prediction is not judged yet; a second line, or a rate near the prediction, is."""
    state = initial_state(Candidate(strategy=ONE_GPU_8, predicted_tokens_per_s=1000.0))
    trial = Candidate(strategy=ONE_GPU_16, predicted_tokens_per_s=1600.0, fitted_on=2, trial=True)
    state = after_switch(state, new=trial, old_measured_tokens_per_s=1000.0, switch_cost_s=0.1, in_place=True)

    wide = dataclasses.replace(IN_PLACE, trial_prediction_error=0.25)

    def at(tokens_per_s: float, intervals: int, settings: PolicySettings = wide):
        measurement = dataclasses.replace(
            measure(20.0, tokens_per_s=tokens_per_s, remaining=1e6), measured_intervals=intervals
        )
        return decide(state, measurement, None, settings)

    waited = at(700.0, 1)  # 700 x 1.25 < 1600: maybe warm-up
    assert waited.action == "stay" and "measured once more" in waited.reason
    assert waited.state.below_break_even == 0
    assert at(700.0, 2).action == "switch"  # measured twice: judged
    assert at(1300.0, 1).action == "switch"  # 1300 x 1.25 >= 1600: judged now (and it loses)
    assert at(1300.0, 1, IN_PLACE).action == "stay"  # the default margin, 15%: 1300 x 1.15 < 1600
    assert at(700.0, 0).action == "switch"  # intervals not counted (a simulation): judged
    raw_model = after_switch(
        initial_state(Candidate(strategy=ONE_GPU_8, predicted_tokens_per_s=1000.0)),
        new=dataclasses.replace(trial, fitted_on=0),
        old_measured_tokens_per_s=1000.0,
        switch_cost_s=0.1,
        in_place=True,
    )
    measurement = dataclasses.replace(measure(20.0, tokens_per_s=700.0, remaining=1e6), measured_intervals=1)
    assert decide(raw_model, measurement, None, IN_PLACE).action == "switch"  # the raw model's: no wait


def _with_fallback() -> PolicySettings:
    return dataclasses.replace(IN_PLACE, fallback=True)


def test_a_trial_that_measures_slow_is_left_without_the_fallback_setting_and_says_so():
    state = initial_state(Candidate(strategy=ONE_GPU_8, predicted_tokens_per_s=1000.0))
    trial = Candidate(strategy=ONE_GPU_16, predicted_tokens_per_s=1150.0, trial=True)
    state = after_switch(state, new=trial, old_measured_tokens_per_s=1000.0, switch_cost_s=0.5, in_place=True)
    assert state.measured_in_place_cost_s == 0.5 and state.measured_switch_cost_s is None
    assert not IN_PLACE.fallback and IN_PLACE.fallback_patience > 1
    # Measured 1.05x the gbs-16 rate: at noise scale 20 the larger batch loses, at its first measured rate.
    decision = decide(state, measure(20.0, tokens_per_s=1050.0, remaining=1e6), None, IN_PLACE)
    assert decision.action == "switch" and decision.record["below_break_even"] == 1
    assert decision.reason.startswith("leaving the in-place trial of gbs 32, its measured rate does not pay")
    assert decision.target.strategy == ONE_GPU_8 and decision.record["in_place"]
    fallback = decide(state, measure(20.0, tokens_per_s=1050.0, remaining=1e6), None, _with_fallback())
    assert fallback.action == "fallback" and "leaving" not in fallback.reason
    # A trial that pays stays (1.9x the rate: break-even noise scale (1000*16 - 1900*8) / 900 = 0.9).
    assert decide(state, measure(20.0, tokens_per_s=1900.0, remaining=1e6), None, IN_PLACE).action == "stay"


def test_a_plain_switch_falls_back_only_after_the_patience():
    state = initial_state(Candidate(strategy=ONE_GPU_8, predicted_tokens_per_s=1000.0))
    plain = Candidate(strategy=ONE_GPU_16, predicted_tokens_per_s=1150.0)
    state = after_switch(state, new=plain, old_measured_tokens_per_s=1000.0, switch_cost_s=0.5, in_place=True)
    settings = dataclasses.replace(IN_PLACE, fallback=True)
    actions = []
    for _ in range(settings.fallback_patience):
        decision = decide(state, measure(20.0, tokens_per_s=1050.0, remaining=1e6), None, settings)
        state = decision.state
        actions.append(decision.action)
    assert actions == ["stay"] * (settings.fallback_patience - 1) + ["fallback"]


def test_a_trial_left_for_a_larger_trial_is_judged_again_after_the_fallback_to_it():
    """gbs 16 -> 32 (trial) -> 64 (trial) -> fallback to 32: the trial of 32 was never judged, so the policy
    keeps judging it and falls back to 16 when 32 does not pay either (on the H200, runs stayed for good on
    the unjudged trial they fell back to)."""
    state = initial_state(Candidate(strategy=ONE_GPU_8, predicted_tokens_per_s=1000.0))
    for strategy, rate in ((ONE_GPU_16, 1000.0), (ONE_GPU_32, 1050.0)):
        trial = Candidate(strategy=strategy, predicted_tokens_per_s=1150.0, trial=True)
        state = after_switch(
            state, new=trial, old_measured_tokens_per_s=rate, switch_cost_s=0.0, in_place=True
        )
    assert [stage.trial for stage in state.earlier] == [False, True]

    def judge(state, tokens_per_s):  # a trial is judged at its first measured rate
        return decide(state, measure(20.0, tokens_per_s=tokens_per_s, remaining=1e6), None, IN_PLACE)

    back = judge(state, 1100.0)  # gbs 64 at 1.05x the rate of 32: back to 32, still a trial
    assert back.action == "switch" and back.target.strategy == ONE_GPU_16 and back.target.trial
    state = after_switch(back.state, new=back.target, old_measured_tokens_per_s=1100.0, switch_cost_s=0.0)
    again = judge(state, 1050.0)  # gbs 32 at 1.05x the rate of 16
    assert again.action == "switch" and again.target.strategy == ONE_GPU_8 and not again.target.trial


def test_a_backend_that_keeps_mbs_in_place_switches_an_mbs_change_through_a_checkpoint():
    """ONE_GPU_8 -> ONE_GPU_16 changes mbs too: in place for the native engine, through a checkpoint (its
    own cost, no trial) where in-place switches change the gbs only (Megatron-DeepSpeed)."""
    state = initial_state(Candidate(strategy=ONE_GPU_8, predicted_tokens_per_s=1000.0))
    candidate = Candidate(strategy=ONE_GPU_16, predicted_tokens_per_s=1150.0)
    measurement = measure(20.0, tokens_per_s=1000.0, remaining=1e5)
    gbs_only = dataclasses.replace(IN_PLACE, in_place_mbs=False, predicted_switch_cost_s=10.0)
    assert switches_in_place(ONE_GPU_8, ONE_GPU_16, IN_PLACE)
    assert not switches_in_place(ONE_GPU_8, ONE_GPU_16, gbs_only)
    decision = decide(state, measurement, candidate, gbs_only)
    assert decision.action == "stay" and not decision.record["in_place"]
    assert decision.record["switch_cost_s"] == 10.0
    same_mbs = dataclasses.replace(ONE_GPU_16, mbs=8)
    assert switches_in_place(ONE_GPU_8, same_mbs, gbs_only)
    assert not switches_in_place(ONE_GPU_8, dataclasses.replace(same_mbs, dp=2), gbs_only)


def test_an_unknown_noise_scale_counts_the_measurements_the_tracker_holds():
    """Before it has ``min_samples`` the tracker gives no estimate; the reason still says how many it has
    (an H200 run said "0 of 10" at iterations 16 and 24 while it held 8 and 9)."""
    held = tracker_at(20.0, 6)
    assert held.estimate() is None
    measurement = Measurement(
        time=0.0,
        iteration=16,
        consumed_tokens=1_000,
        noise=held.estimate(),
        noise_measurements=len(held.measurements),
        measured_tokens_per_s=1000.0,
        remaining_tokens=1e7,
    )
    decision = decide(fresh_state(), measurement, CANDIDATE, SETTINGS)
    assert decision.action == "stay" and decision.record["noise_samples"] == 6
    assert decision.reason == f"noise scale unknown: 6 of {SETTINGS.min_measurements} measurements needed"


def test_on_a_predicted_current_rate_a_switch_that_pays_is_made_only_as_an_in_place_trial():
    state = initial_state(Candidate(strategy=ONE_GPU_8, predicted_tokens_per_s=1000.0))
    candidate = Candidate(strategy=ONE_GPU_16, predicted_tokens_per_s=1800.0)
    measured = measure(1000.0, tokens_per_s=1000.0)
    predicted = dataclasses.replace(measured, rate_measured=False)
    committing = dataclasses.replace(IN_PLACE, measure_before_commit=False)
    plain = decide(state, measured, candidate, committing)
    assert plain.action == "switch" and not plain.target.trial  # it pays: measured, a plain switch
    tried = decide(state, predicted, candidate, IN_PLACE)
    assert tried.action == "switch" and tried.target.trial and "trial in place" in tried.reason
    assert tried.record["current"]["rate_measured"] is False
    assert tried.record["predicted_over_measured"] is None
    # Through a checkpoint there is no trial: the run waits for a measured rate.
    two_gpus = Strategy(dp=2, tp=1, pp=1, mbs=8, gbs=32)
    other_layout = Candidate(strategy=two_gpus, predicted_tokens_per_s=1800.0)
    assert decide(state, predicted, other_layout, IN_PLACE).action == "stay"


def test_with_measure_before_commit_a_switch_on_a_predicted_rate_is_a_trial_left_if_its_rate_does_not_pay():
    """``training.measure_before_commit`` (on by default): the fitted predictions of gbs 32 on the H200 ran
    4-10% above what it measured eager, and a switch made on one stayed for good (fallback off)."""
    state = initial_state(Candidate(strategy=ONE_GPU_8, predicted_tokens_per_s=1000.0))
    candidate = Candidate(strategy=ONE_GPU_16, predicted_tokens_per_s=1800.0)  # pays at noise scale 20
    measurement = measure(20.0, tokens_per_s=1000.0, remaining=1e6)
    committing = dataclasses.replace(IN_PLACE, measure_before_commit=False)
    assert not decide(state, measurement, candidate, committing).target.trial  # committed on the prediction
    settings = IN_PLACE
    assert settings.measure_before_commit
    tried = decide(state, measurement, candidate, settings)
    assert tried.action == "switch" and tried.target.trial and "its rate is only predicted" in tried.reason
    # A measured candidate, or one behind a checkpoint, is switched to as before.
    known = dataclasses.replace(candidate, throughput_source="measured")
    assert not decide(state, measurement, known, settings).target.trial
    elsewhere = Candidate(strategy=Strategy(dp=2, tp=1, pp=1, mbs=8, gbs=32), predicted_tokens_per_s=1800.0)
    checkpointed = decide(state, measurement, elsewhere, settings)
    assert checkpointed.action == "switch" and not checkpointed.target.trial
    # Measured at 1200 tokens/s the larger batch breaks even only at noise scale 64: left again.
    state = after_switch(
        tried.state, new=tried.target, old_measured_tokens_per_s=1000.0, switch_cost_s=0.5, in_place=True
    )
    judged = decide(state, measure(20.0, tokens_per_s=1200.0, remaining=1e6), None, settings)
    assert judged.action == "switch" and judged.target.strategy == ONE_GPU_8
    assert decide(state, measure(20.0, tokens_per_s=1800.0, remaining=1e6), None, settings).action == "stay"
