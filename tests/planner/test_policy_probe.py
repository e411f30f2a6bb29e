"""The policy with probes: the prior says when to probe; the probe's outcome, not the noise scale, decides."""

from __future__ import annotations

import dataclasses

from tests.helpers.policy_cases import BASE, SETTINGS, SMALL, branch, fresh_state, measure, outcome

from cona.planner.policy import Candidate, decide, initial_state
from cona.planner.policy_probe import PROBE_SPACING, hoped_rate
from cona.planner.probe_rule import ProbeOutcome, judge
from cona.strategy import Strategy

IN_PLACE_LARGE = Strategy(dp=4, tp=1, pp=1, mbs=8, gbs=32)  # SMALL's layout at twice the batch
CANDIDATE = Candidate(strategy=IN_PLACE_LARGE, predicted_tokens_per_s=1800.0)
PROBING = dataclasses.replace(
    SETTINGS, in_place=True, probe=True, probe_tokens=8192, predicted_in_place_cost_s=1.0
)


def test_a_layout_keeping_candidate_is_probed_even_where_the_noise_scale_says_it_loses():
    # noise scale 1: the model credits gbs 32's tokens at (1+16)/(1+32) of gbs 16's, so it says 0.93x.
    decision = decide(fresh_state(), measure(1.0), CANDIDATE, PROBING)
    assert decision.action == "probe" and decision.target == CANDIDATE
    assert decision.record["prior_progress_ratio"] < 1.0
    assert decision.record["probe_request"] == {"tokens": 8192, "tolerance": 0.01}
    assert decision.state.probing == CANDIDATE
    # Without probes the noise-scale model decides alone, and says the candidate does not pay.
    plain = decide(fresh_state(), measure(1.0), CANDIDATE, dataclasses.replace(PROBING, probe=False))
    assert plain.action == "stay" and "would save" in plain.reason


def test_a_probe_is_not_made_where_even_equal_token_value_would_not_pay_for_it():
    decision = decide(fresh_state(), measure(1.0, remaining=20_000), CANDIDATE, PROBING)
    assert decision.action == "stay"
    assert "not more than the probe and switch" in decision.reason


def test_a_model_that_under_read_the_running_strategy_widens_the_bound_up_to_perfect_scaling():
    """Predicted at 1.05x the current rate, gbs 32 bounds a saving of 5% of the time left, under a probe's
    cost here; where the running strategy measured 3.5x what the model predicted for it, the candidate may
    be as far off, up to 2x (twice the batch in the same layout): a probe is worth it."""
    remaining = measure(1.0, tokens_per_s=1000.0, remaining=2e5)
    near = Candidate(strategy=IN_PLACE_LARGE, predicted_tokens_per_s=1050.0)
    assert decide(fresh_state(), remaining, near, PROBING).action == "stay"
    under_read = initial_state(Candidate(strategy=SMALL, predicted_tokens_per_s=1000.0 / 3.5))
    decision = decide(under_read, remaining, near, PROBING)
    assert decision.action == "probe" and "with the model's miss on the running strategy" in decision.reason
    assert decision.record["probe_plan"]["hoped_tokens_per_s"] == 2000.0  # perfect scaling, not 3.5x
    assert hoped_rate(under_read, near, 1000.0) == 2000.0
    assert hoped_rate(fresh_state(), near, 1000.0) == 1050.0  # the model met the running strategy
    overshot = initial_state(Candidate(strategy=SMALL, predicted_tokens_per_s=2000.0))
    assert hoped_rate(overshot, near, 1000.0) == 1050.0


def test_a_layout_change_is_never_probed():
    other_layout = Candidate(
        strategy=Strategy(dp=2, tp=2, pp=1, mbs=8, gbs=32), predicted_tokens_per_s=1800.0
    )
    decision = decide(fresh_state(), measure(1.0), other_layout, PROBING)
    assert decision.action != "probe"


def test_a_won_probe_is_a_switch_at_the_probed_rate_and_a_lost_one_waits_for_the_tokens_to_grow():
    asked = decide(fresh_state(), measure(1.0), CANDIDATE, PROBING)
    won = decide(asked.state, dataclasses.replace(measure(1.0), probe=outcome(4.005)), CANDIDATE, PROBING)
    assert won.action == "switch" and won.target.strategy == IN_PLACE_LARGE
    assert won.target.throughput_source == "probed"
    assert won.target.predicted_tokens_per_s == 4096 * 8 / 2.0
    assert (
        won.reason.startswith("probe of gbs 32")
        and "equal loss within the tolerance, and faster" in won.reason
    )
    assert won.record["probe"]["winner"] == "candidate" and won.state.probing is None

    lost = decide(asked.state, dataclasses.replace(measure(1.0), probe=outcome(4.3)), CANDIDATE, PROBING)
    assert lost.action == "stay" and lost.record["probe"]["winner"] == "current"
    assert "not larger" in lost.reason
    assert lost.state.probed[0].gbs == 32 and lost.state.probed[0].consumed_tokens == 10_000
    later = dataclasses.replace(measure(1.0), consumed_tokens=int(10_000 * PROBE_SPACING) - 1)
    assert decide(lost.state, later, CANDIDATE, PROBING).action == "stay"
    due = dataclasses.replace(later, consumed_tokens=int(10_000 * PROBE_SPACING))
    assert decide(lost.state, due, CANDIDATE, PROBING).action == "probe"
    grown_noise = decide(lost.state, measure(1.0 * PROBE_SPACING + 0.5), CANDIDATE, PROBING)
    assert grown_noise.action == "probe"


def test_the_rule_ties_go_to_the_faster_branch_and_differences_to_the_larger_loss_drop_per_second():
    current = branch(16, 4.0, 4.0)
    assert (
        judge(start_loss=4.2, current=current, candidate=branch(32, 4.009, 2.0), tolerance=0.01)[0]
        == "candidate"
    )
    assert (
        judge(start_loss=4.2, current=current, candidate=branch(32, 4.0, 4.0), tolerance=0.01)[0] == "current"
    )
    # 0.1 nats worse in half the time: 0.1 nats/s vs 0.05: the candidate lowers the loss faster per second
    assert (
        judge(start_loss=4.2, current=current, candidate=branch(32, 4.1, 1.0), tolerance=0.01)[0]
        == "candidate"
    )
    assert (
        judge(start_loss=4.2, current=current, candidate=branch(32, 4.15, 2.0), tolerance=0.01)[0]
        == "current"
    )
    assert judge(start_loss=4.2, current=current, candidate=branch(32, float("nan"), 1.0), tolerance=0.01)[
        0
    ] == ("current")


def test_a_probe_outcome_round_trips_through_its_json_line():
    probe = outcome(4.005)
    assert ProbeOutcome.from_dict(probe.to_dict()) == probe
    assert BASE == 16 and SMALL.gbs == 16  # the cases this file builds on
