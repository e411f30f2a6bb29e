"""``training.noise_scale_agreement``: switches up only where the windowed noise scale and its EMA both say
the larger gbs pays, falls back only where both say it does not (the H200 runs of issue 16 moved up on one
high windowed reading and left trials on a lagging EMA)."""

import dataclasses

import pytest
from tests.planner.policy_cases import BASE, measure

from cona.config import TrainingConfig
from cona.planner.policy import Candidate, PolicySettings, after_switch, decide, initial_state
from cona.strategy import Strategy

GBS_16 = Strategy(dp=1, tp=1, pp=1, mbs=16, gbs=16)
GBS_32 = Strategy(dp=1, tp=1, pp=1, mbs=32, gbs=32)
EACH = PolicySettings(base_gbs=BASE, max_gbs=64, in_place=True, predicted_in_place_cost_s=1.0)
AGREE = dataclasses.replace(EACH, noise_scale_agreement=True)


def test_one_high_windowed_reading_does_not_move_the_run_up_while_the_ema_disagrees():
    # gbs 32 measured at 1.75x gbs 16's rate: it makes (phi + 16) / (phi + 32) x 1.75 of the progress, 1.05x
    # at phi 7.8 (the windowed reading) and 0.95x at the EMA after it, 0.1 x 7.8 + 0.9 x 2.3 = 2.85.
    state = dataclasses.replace(
        initial_state(Candidate(strategy=GBS_16, predicted_tokens_per_s=1000.0)), noise_ema=2.3
    )
    candidate = Candidate(strategy=GBS_32, predicted_tokens_per_s=1750.0, throughput_source="measured")
    spike = measure(7.8, tokens_per_s=1000.0)
    assert decide(state, spike, candidate, EACH).action == "switch"
    held = decide(state, spike, candidate, AGREE)
    assert held.action == "stay" and held.record["noise_scale_for_switch"] == pytest.approx(2.85)
    assert held.record["candidate"]["progress_per_s"] == pytest.approx(1750.0 * 18.85 / 34.85)
    # Both estimates high: the switch is made.
    agreed = dataclasses.replace(state, noise_ema=9.0)
    decision = decide(agreed, spike, candidate, AGREE)
    assert decision.action == "switch" and "noise_scale_for_switch" not in decision.record


def test_a_trial_the_windowed_reading_backs_is_not_left_on_a_lagging_ema():
    # The trial of gbs 32 measures 1500 tokens/s against gbs 16's 1000: break-even phi 16.
    state = initial_state(Candidate(strategy=GBS_16, predicted_tokens_per_s=1000.0))
    trial = Candidate(strategy=GBS_32, predicted_tokens_per_s=1900.0, trial=True)
    state = after_switch(state, new=trial, old_measured_tokens_per_s=1000.0, switch_cost_s=0.5, in_place=True)
    state = dataclasses.replace(state, noise_ema=5.0)
    backed = measure(30.0, tokens_per_s=1500.0, remaining=1e6)
    assert decide(state, backed, None, EACH).action == "switch"  # EMA 0.1 x 30 + 0.9 x 5 = 7.5
    kept = decide(state, backed, None, AGREE)
    assert kept.action == "stay" and kept.record["fallback_break_even_noise_scale"] == pytest.approx(16.0)
    # Both estimates below the break-even: the trial is left, and the reason names the higher one.
    low = decide(state, measure(10.0, tokens_per_s=1500.0, remaining=1e6), None, AGREE)
    assert low.action == "switch" and low.target.strategy == GBS_16
    assert "noise scale (the higher estimate) 10" in low.reason


def test_the_setting_comes_from_the_training_config():
    training = TrainingConfig(base_gbs=8, noise_scale_agreement=True)
    assert PolicySettings.from_training(training, max_gbs=64).noise_scale_agreement
    assert not PolicySettings.from_training(TrainingConfig(base_gbs=8), max_gbs=64).noise_scale_agreement
