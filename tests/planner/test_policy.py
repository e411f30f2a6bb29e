"""The switching policy on synthetic metrics: noise-scale measurements built to give a chosen noise scale."""

import dataclasses
import json

import pytest

from cona.config import TrainingConfig
from cona.errors import PlanError
from cona.planner.efficiency import NoiseScaleTracker
from cona.planner.policy import (
    Candidate,
    Measurement,
    PolicySettings,
    after_switch,
    break_even_noise_scale,
    decide,
    initial_state,
    next_frontier,
    next_gbs,
    prediction_miss,
    switches_in_place,
)
from cona.strategy import Strategy

BASE = 16
SMALL = Strategy(dp=4, tp=1, pp=1, mbs=4, gbs=16)
LARGE = Strategy(dp=2, tp=2, pp=1, mbs=8, gbs=32)
SETTINGS = PolicySettings(base_gbs=BASE, max_gbs=64, predicted_switch_cost_s=10.0)


def tracker_at(noise_scale: float, count: int = 20, grad_sqr: float = 1.0) -> NoiseScaleTracker:
    """A tracker fed ``count`` exact two-batch measurements of ``|G|^2`` and ``tr(Sigma) = phi |G|^2``."""
    tracker = NoiseScaleTracker(base_batch=BASE)
    trace_sigma = noise_scale * abs(grad_sqr)
    for _ in range(count):
        tracker = tracker.update(
            small_sqr=grad_sqr + trace_sigma / 4,
            big_sqr=grad_sqr + trace_sigma / 16,
            small_batch=4,
            big_batch=16,
        )
    return tracker


def measure(noise_scale: float, *, tokens_per_s: float = 1000.0, remaining: float = 1e7, count: int = 20):
    return Measurement(
        time=0.0,
        iteration=100,
        consumed_tokens=10_000,
        noise=tracker_at(noise_scale, count).estimate(),
        measured_tokens_per_s=tokens_per_s,
        remaining_tokens=remaining,
    )


def fresh_state():
    return initial_state(Candidate(strategy=SMALL, predicted_tokens_per_s=1000.0))


CANDIDATE = Candidate(strategy=LARGE, predicted_tokens_per_s=1800.0)


def test_frontier_doubles_caps_and_follows_a_list():
    assert next_gbs(16, SETTINGS) == 32
    assert next_gbs(48, SETTINGS) == 64
    assert next_gbs(64, SETTINGS) is None
    listed = PolicySettings(base_gbs=BASE, max_gbs=100, gbs_list=(16, 24, 40, 128))
    assert next_gbs(16, listed) == 24
    assert next_gbs(40, listed) is None


def test_rising_noise_scale_triggers_a_switch_past_break_even():
    # Break-even of 1000 tok/s at gbs 16 vs 1800 at gbs 32: 1000/(phi+16) = 1800/(phi+32) -> phi = 4.
    state, actions = fresh_state(), []
    for noise_scale in (0.5, 1.0, 2.0, 3.0, 8.0, 50.0):
        decision = decide(state, measure(noise_scale), CANDIDATE, SETTINGS)
        state = decision.state
        actions.append(decision.action)
    assert actions == ["stay", "stay", "stay", "stay", "switch", "switch"]
    assert decision.target == CANDIDATE


def test_a_candidate_that_wins_by_less_than_the_switch_cost_does_not_switch():
    # At phi = 50 the candidate makes 1.45x the progress: it saves 31 % of the remaining time.
    short = decide(fresh_state(), measure(50.0, remaining=25_000.0), CANDIDATE, SETTINGS)  # 25 s left
    assert short.action == "stay"
    assert short.record["time_saved_s"] < SETTINGS.predicted_switch_cost_s
    long = decide(fresh_state(), measure(50.0, remaining=50_000.0), CANDIDATE, SETTINGS)  # 50 s left
    assert long.action == "switch"


def test_no_switch_or_fallback_when_training_ends_within_two_evaluations():
    interval = 4_000.0  # tokens between evaluations
    near_end = dataclasses.replace(measure(50.0, remaining=2 * interval), interval_tokens=interval)
    assert decide(fresh_state(), near_end, CANDIDATE, SETTINGS).action == "stay"
    assert "training ends within 2 evaluations" in decide(fresh_state(), near_end, CANDIDATE, SETTINGS).reason
    further = dataclasses.replace(near_end, remaining_tokens=1e7)
    assert decide(fresh_state(), further, CANDIDATE, SETTINGS).action == "switch"
    # A fall-back the patience count has reached waits too.
    state, settings = switched_state(fallback=True)
    for noise_scale in (500.0, 1.0, 1.0, 1.0, 1.0, 1.0):
        state = decide(state, measure(noise_scale, tokens_per_s=1200.0), None, settings).state
    ending = dataclasses.replace(
        measure(1.0, tokens_per_s=1200.0, remaining=interval), interval_tokens=interval
    )
    assert decide(state, ending, None, settings).action == "stay"
    assert decide(state, measure(1.0, tokens_per_s=1200.0), None, settings).action == "fallback"


def test_hysteresis_refuses_a_saving_just_above_the_cost():
    decision = decide(fresh_state(), measure(50.0, remaining=33_000.0), CANDIDATE, SETTINGS)
    saved = decision.record["time_saved_s"]
    assert SETTINGS.predicted_switch_cost_s < saved < SETTINGS.predicted_switch_cost_s * 1.05
    assert decision.action == "stay"


def test_unknown_noise_scale_never_switches():
    free = PolicySettings(base_gbs=BASE, max_gbs=64, predicted_switch_cost_s=0.0)
    negative = Measurement(
        time=0.0,
        iteration=1,
        consumed_tokens=1,
        noise=tracker_at(1e6, grad_sqr=-1.0).estimate(),
        measured_tokens_per_s=1.0,
        remaining_tokens=1e12,
    )
    assert negative.noise.grad_sqr < 0
    decision = decide(fresh_state(), negative, CANDIDATE, free)
    assert decision.action == "stay" and "|G|^2" in decision.reason
    few = decide(fresh_state(), measure(1e6, count=free.min_measurements - 1), CANDIDATE, free)
    assert few.action == "stay" and "measurements" in few.reason
    enough = decide(fresh_state(), measure(1e6, count=free.min_measurements), CANDIDATE, free)
    assert enough.action == "switch"


def switched_state(fallback: bool, patience: int = 3):
    settings = PolicySettings(
        base_gbs=BASE,
        max_gbs=64,
        fallback=fallback,
        fallback_ema_alpha=0.5,
        fallback_patience=patience,
        predicted_switch_cost_s=10.0,
    )
    state = after_switch(
        fresh_state(),
        new=Candidate(strategy=LARGE, predicted_tokens_per_s=1200.0),
        old_measured_tokens_per_s=1000.0,
        switch_cost_s=12.0,
    )
    return state, settings


def test_falling_noise_scale_falls_back_after_patience_not_before():
    # 1000 tok/s at gbs 16 vs 1200 at gbs 32 break even at phi = 64. The EMA (alpha 0.5) from 500 towards 1
    # goes 500, 250, 126, 63 (x1.05 not below 64), 32 (1st below), 17 (2nd), 9 (3rd: fall back).
    state, settings = switched_state(fallback=True)
    assert break_even_noise_scale(state.earlier[-1], 32, 1200.0) == pytest.approx(64.0)
    actions = []
    for noise_scale in (500.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0):
        decision = decide(state, measure(noise_scale, tokens_per_s=1200.0), None, settings)
        state = decision.state
        actions.append(decision.action)
    assert actions == ["stay"] * 6 + ["fallback"]
    assert decision.target == Candidate(
        strategy=SMALL, predicted_tokens_per_s=1000.0, throughput_source="measured"
    )
    assert decision.record["below_break_even"] == 3
    back = after_switch(
        state,
        new=decision.target,
        old_measured_tokens_per_s=1200.0,
        switch_cost_s=8.0,
    )
    assert back.earlier == () and back.measured_switch_cost_s == pytest.approx(10.0)


def test_a_recovering_noise_scale_resets_the_patience_count():
    # EMA: 500, 250, 126, 63, 32 (below 1), 17 (2), 108 (recovered: 0), 55 (1), 28 (2), 14 (3: fall back).
    state, settings = switched_state(fallback=True)
    actions = []
    for noise_scale in (500.0, 1.0, 1.0, 1.0, 1.0, 1.0, 200.0, 1.0, 1.0, 1.0):
        decision = decide(state, measure(noise_scale, tokens_per_s=1200.0), None, settings)
        state = decision.state
        actions.append(decision.action)
    assert actions == ["stay"] * 9 + ["fallback"]


def test_without_fallback_a_falling_noise_scale_stays():
    state, settings = switched_state(fallback=False)
    for noise_scale in (500.0, *([1.0] * 10)):
        decision = decide(state, measure(noise_scale, tokens_per_s=1200.0), None, settings)
        state = decision.state
        assert decision.action == "stay"


def test_the_decision_record_is_one_json_line_with_the_numbers():
    decision = decide(fresh_state(), measure(50.0), CANDIDATE, SETTINGS)
    record = json.loads(json.dumps(decision.record))
    for key in (
        "time",
        "iteration",
        "consumed_tokens",
        "noise_scale",
        "switch_cost_s",
        "remaining_s",
        "reason",
    ):
        assert key in record
    assert record["decision"] == "switch"
    assert record["current"]["measured_tokens_per_s"] == 1000.0
    assert record["current"]["efficiency"] == pytest.approx(1.0)
    assert record["candidate"]["efficiency"] == pytest.approx((50 + 16) / (50 + 32))
    assert record["candidate"]["progress_per_s"] == pytest.approx(1800 * 66 / 82)
    assert record["predicted_over_measured"] == pytest.approx(1.0)
    assert record["switch_cost_source"] == "predicted"


def test_settings_from_training_and_refused_values():
    training = TrainingConfig(base_gbs=8, fallback=True, fallback_patience=5)
    settings = PolicySettings.from_training(training, max_gbs=128, hysteresis=0.1)
    assert (settings.base_gbs, settings.fallback_patience, settings.hysteresis) == (8, 5, 0.1)
    with pytest.raises(PlanError, match="factor"):
        PolicySettings(base_gbs=8, max_gbs=64, gbs_factor=1)


def test_the_frontier_skips_candidates_that_can_never_win():
    found = {
        32: Candidate(
            strategy=LARGE, predicted_tokens_per_s=900.0
        ),  # slower than the current 1000: never wins
        64: Candidate(strategy=Strategy(dp=4, tp=1, pp=1, mbs=16, gbs=64), predicted_tokens_per_s=2000.0),
    }
    assert next_frontier(16, 1000.0, SETTINGS, found.get) == found[64]
    assert next_frontier(16, 2500.0, SETTINGS, found.get) is None
    assert next_frontier(16, 1000.0, SETTINGS, {64: found[64]}.get) == found[64]  # nothing fits at 32


def test_a_larger_batch_that_is_not_even_faster_falls_back_whatever_the_noise():
    state, settings = switched_state(fallback=True)
    actions = []
    for _ in range(3):  # measured 950 tok/s at gbs 32 against 1000 at gbs 16: never breaks even
        decision = decide(state, measure(1e6, tokens_per_s=950.0), None, settings)
        state = decision.state
        actions.append(decision.action)
    assert actions == ["stay", "stay", "fallback"]
    record = json.loads(json.dumps(decision.record, allow_nan=False))
    assert record["fallback_break_even_noise_scale"] is None


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
    assert at(700.0, 2).action == "fallback"  # measured twice: judged
    assert at(1300.0, 1).action == "fallback"  # 1300 x 1.25 >= 1600: judged now (and it loses)
    assert at(1300.0, 1, IN_PLACE).action == "stay"  # the default margin, 15%: 1300 x 1.15 < 1600
    assert at(700.0, 0).action == "fallback"  # intervals not counted (a simulation): judged
    raw_model = after_switch(
        initial_state(Candidate(strategy=ONE_GPU_8, predicted_tokens_per_s=1000.0)),
        new=dataclasses.replace(trial, fitted_on=0),
        old_measured_tokens_per_s=1000.0,
        switch_cost_s=0.1,
        in_place=True,
    )
    measurement = dataclasses.replace(measure(20.0, tokens_per_s=700.0, remaining=1e6), measured_intervals=1)
    assert decide(raw_model, measurement, None, IN_PLACE).action == "fallback"  # the raw model's: no wait


def test_a_trial_that_measures_slow_falls_back_without_the_fallback_setting():
    state = initial_state(Candidate(strategy=ONE_GPU_8, predicted_tokens_per_s=1000.0))
    trial = Candidate(strategy=ONE_GPU_16, predicted_tokens_per_s=1150.0, trial=True)
    state = after_switch(state, new=trial, old_measured_tokens_per_s=1000.0, switch_cost_s=0.5, in_place=True)
    assert state.measured_in_place_cost_s == 0.5 and state.measured_switch_cost_s is None
    assert not IN_PLACE.fallback and IN_PLACE.fallback_patience > 1
    # Measured 1.05x the gbs-16 rate: at noise scale 20 the larger batch loses, at its first measured rate.
    decision = decide(state, measure(20.0, tokens_per_s=1050.0, remaining=1e6), None, IN_PLACE)
    assert decision.action == "fallback" and decision.record["below_break_even"] == 1
    assert decision.target.strategy == ONE_GPU_8 and decision.record["in_place"]
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
    assert back.action == "fallback" and back.target.strategy == ONE_GPU_16 and back.target.trial
    state = after_switch(back.state, new=back.target, old_measured_tokens_per_s=1100.0, switch_cost_s=0.0)
    again = judge(state, 1050.0)  # gbs 32 at 1.05x the rate of 16
    assert again.action == "fallback" and again.target.strategy == ONE_GPU_8 and not again.target.trial


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
    plain = decide(state, measured, candidate, IN_PLACE)
    assert plain.action == "switch" and not plain.target.trial  # it pays: measured, a plain switch
    tried = decide(state, predicted, candidate, IN_PLACE)
    assert tried.action == "switch" and tried.target.trial and "trial in place" in tried.reason
    assert tried.record["current"]["rate_measured"] is False
    assert tried.record["predicted_over_measured"] is None
    # Through a checkpoint there is no trial: the run waits for a measured rate.
    two_gpus = Strategy(dp=2, tp=1, pp=1, mbs=8, gbs=32)
    other_layout = Candidate(strategy=two_gpus, predicted_tokens_per_s=1800.0)
    assert decide(state, predicted, other_layout, IN_PLACE).action == "stay"
