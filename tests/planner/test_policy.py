"""The switching policy on synthetic metrics: noise-scale measurements built to give a chosen noise scale
(:mod:`tests.helpers.policy_cases`). In-place switches: test_policy_in_place.py; probes:
test_policy_probe.py."""

import dataclasses
import json

import pytest
from tests.helpers.policy_cases import (
    BASE,
    CANDIDATE,
    LARGE,
    SETTINGS,
    SMALL,
    fresh_state,
    measure,
    tracker_at,
)

from cona.config import TrainingConfig
from cona.errors import PlanError
from cona.planner.policy import (
    Candidate,
    Measurement,
    PolicySettings,
    after_switch,
    break_even_noise_scale,
    decide,
    next_frontier,
    next_gbs,
)
from cona.strategy import Strategy


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


def test_the_noise_scale_factor_decides_as_the_scaled_noise_scale_would():
    """``noise_scale_factor`` k with a measured noise scale phi decides as k = 1 with k x phi: the same
    actions, efficiencies and progress; the record keeps the measured value."""
    scaled = dataclasses.replace(SETTINGS, noise_scale_factor=4.0)
    for noise_scale in (0.5, 1.0, 2.0, 8.0):
        with_factor = decide(fresh_state(), measure(noise_scale), CANDIDATE, scaled)
        as_measured = decide(fresh_state(), measure(4.0 * noise_scale), CANDIDATE, SETTINGS)
        assert with_factor.action == as_measured.action
        for key in ("current", "candidate"):
            assert with_factor.record[key]["progress_per_s"] == pytest.approx(
                as_measured.record[key]["progress_per_s"]
            )
        assert with_factor.record["noise_scale"] == pytest.approx(noise_scale)
        assert with_factor.record["noise_scale_factor"] == 4.0
    # Break-even phi = 4 (above): measured 2 stays at k = 1 and switches at k = 4.
    assert decide(fresh_state(), measure(2.0), CANDIDATE, SETTINGS).action == "stay"
    assert decide(fresh_state(), measure(2.0), CANDIDATE, scaled).action == "switch"


def test_settings_from_training_and_refused_values():
    training = TrainingConfig(
        base_gbs=8, fallback=True, fallback_patience=5, probe=True, probe_tokens=4096, probe_tolerance=0.02
    )  # fmt: skip
    settings = PolicySettings.from_training(training, max_gbs=128, hysteresis=0.1)
    assert (settings.base_gbs, settings.fallback_patience, settings.hysteresis) == (8, 5, 0.1)
    assert (settings.probe, settings.probe_tokens, settings.probe_tolerance) == (True, 4096, 0.02)
    assert settings.noise_scale_factor == 1.0
    assert (
        PolicySettings.from_training(TrainingConfig(noise_scale_factor=4.0), max_gbs=64).noise_scale_factor
        == 4.0
    )
    with pytest.raises(PlanError, match="factor"):
        PolicySettings(base_gbs=8, max_gbs=64, gbs_factor=1)
    with pytest.raises(PlanError, match="noise_scale_factor"):
        PolicySettings(base_gbs=8, max_gbs=64, noise_scale_factor=0.0)


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
    assert record["fallback_previous_rate_measured"] is True


def test_the_record_says_when_the_break_even_rests_on_a_predicted_rate():
    # gbs 16 left before any steady line: its 1000 tok/s is the estimator's, and the record says so.
    state, settings = switched_state(fallback=True)
    state = dataclasses.replace(state, earlier=(dataclasses.replace(state.earlier[-1], rate_measured=False),))
    decision = decide(state, measure(1e6, tokens_per_s=1200.0), None, settings)
    assert decision.record["fallback_previous_rate_measured"] is False
    assert decision.record["fallback_break_even_noise_scale"] == pytest.approx(64.0)
