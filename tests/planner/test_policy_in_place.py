"""The policy's in-place switches without probes (``training.probe`` off), on the synthetic noise scales of
:mod:`tests.helpers.policy_cases`; with probes: test_policy_probe.py."""

import dataclasses

from tests.helpers.policy_cases import (
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
    switches_in_place,
)
from cona.strategy import Strategy

ONE_GPU_8 = Strategy(dp=1, tp=1, pp=1, mbs=8, gbs=16)
ONE_GPU_16 = Strategy(dp=1, tp=1, pp=1, mbs=16, gbs=32)
ONE_GPU_32 = Strategy(dp=1, tp=1, pp=1, mbs=32, gbs=64)
IN_PLACE = PolicySettings(base_gbs=BASE, max_gbs=64, in_place=True, predicted_in_place_cost_s=1.0)


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


def test_a_backend_that_keeps_mbs_in_place_switches_an_mbs_change_through_a_checkpoint():
    """ONE_GPU_8 -> ONE_GPU_16 changes mbs too: in place for the native engine, through a checkpoint (its
    own cost) where in-place switches change the gbs only (Megatron-DeepSpeed)."""
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
    (not "0 of 10" while it holds 8)."""
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


def test_on_a_predicted_current_rate_no_switch_is_made_and_a_slow_switch_stays_without_the_fallback():
    state = initial_state(Candidate(strategy=ONE_GPU_8, predicted_tokens_per_s=1000.0))
    candidate = Candidate(strategy=ONE_GPU_16, predicted_tokens_per_s=1800.0)  # pays at noise scale 20
    measured = measure(20.0, tokens_per_s=1000.0, remaining=1e6)
    switched = decide(state, measured, candidate, IN_PLACE)
    assert switched.action == "switch" and "saves" in switched.reason
    predicted = decide(state, dataclasses.replace(measured, rate_measured=False), candidate, IN_PLACE)
    assert predicted.action == "stay" and "only predicted" in predicted.reason
    assert (
        predicted.record["current"]["rate_measured"] is False
        and predicted.record["predicted_over_measured"] is None
    )
    # Measured at 1200 tokens/s the larger batch breaks even only at noise scale 64: without the fallback
    # setting the run stays (no decision says "fallback" unless it is on).
    state = after_switch(
        switched.state,
        new=switched.target,
        old_measured_tokens_per_s=1000.0,
        switch_cost_s=0.5,
        in_place=True,
    )
    slow = measure(20.0, tokens_per_s=1200.0, remaining=1e6)
    assert decide(state, slow, None, IN_PLACE).action == "stay"
    settings = dataclasses.replace(IN_PLACE, fallback=True, fallback_patience=1)
    back = decide(state, slow, None, settings)
    assert back.action == "fallback" and back.target.strategy == ONE_GPU_8
