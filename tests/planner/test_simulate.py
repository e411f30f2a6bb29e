"""The cluster simulator on SYNTHETIC curves (tests/helpers/synthetic_curves.py): the optimum, the
baselines, CONA's chain through the policy's own code, switch costs and the model's error."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from tests.helpers.synthetic_curves import synthetic_curves

from cona.config import ModelConfig
from cona.planner.chains import chain_time, optimal_assignment
from cona.planner.cluster import Cluster, curves_world, policy_settings
from cona.planner.curves import parse_curves
from cona.planner.policy import Candidate
from cona.planner.probe_replay import probes_lost_s
from cona.planner.simulate import (
    ModelError,
    World,
    compare,
    compare_with_error,
    ramp_assignment,
)
from cona.planner.switch_cost import IN_PLACE_S, predicted_switch_cost_s
from cona.planner.systems import load_system
from cona.strategy import Strategy

CURVES = parse_curves(synthetic_curves(), source="synthetic")


@pytest.mark.parametrize("seed", range(4))
def test_the_optimum_with_a_cost_per_pair_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    times = rng.uniform(0.5, 2.0, size=(6, 3))
    costs = rng.uniform(0.0, 2.0, size=(3, 3))
    np.fill_diagonal(costs, 0.0)
    best = min(chain_time(times, np.asarray(chain), costs) for chain in itertools.product(range(3), repeat=6))
    assert chain_time(times, optimal_assignment(times, costs), costs) == pytest.approx(best)


def hand_world(rates=(100.0, 150.0), segments=8) -> World:
    """Two candidates of one layout; the second gbs needs 1.5x the tokens early and 1.0x late."""
    candidates = tuple(
        Candidate(strategy=Strategy(dp=1, tp=1, pp=1, mbs=4, gbs=gbs), predicted_tokens_per_s=rate)
        for gbs, rate in zip((8, 16), rates, strict=True)
    )
    late = np.linspace(1.5, 1.0, segments)
    tokens = np.stack([np.full(segments, 1000.0), 1000.0 * late], axis=1)
    noise = tuple((None, None) for _ in range(segments))
    costs = np.array([[0.0, 1.0], [1.0, 0.0]])
    return World(
        candidates=candidates, segment_tokens=tokens, noise=noise, switch_costs_s=costs, initial=0, seq=4
    )


def test_the_ramp_moves_on_at_equal_token_milestones_over_its_share():
    world = hand_world(segments=8)
    # the user's gbs needs 8,000 tokens; half of it is 4,000: gbs 16 from the segment that starts there
    assert ramp_assignment(world, share=0.5).tolist() == [0, 0, 0, 0, 1, 1, 1, 1]


def test_every_plan_is_timed_on_the_truth_and_none_beats_the_optimum():
    world = curves_world(CURVES, Cluster(system=load_system("h100_80g"), gpus=64), initial_gbs=16,
                         max_gbs=512, target_loss=3.0, segments=60)  # fmt: skip
    result = compare(world, policy_settings(CURVES, 512), world.believed_tokens_per_s)
    for plan in (*result.baselines, result.online):
        assert plan.time_s >= result.optimum.time_s * (1 - 1e-12)
    assert result.tuned_fixed.time_s <= result.static_user.time_s
    assert result.static_user.stages[0].strategy.gbs == 16 and len(result.static_user.stages) == 1
    assert [s.strategy.gbs for s in result.ramp.stages] == [16, 32, 64, 128, 256, 512]
    assert sum(s.tokens for s in result.online.stages) > 0
    # on 64 GPUs gbs 16 needs tensor parallelism; the online chain leaves it (a layout change, charged)
    assert result.online.stages[-1].strategy.gbs > 16 and result.decisions


def test_cona_beats_the_user_gbs_and_the_token_ramp_on_64_gpus_of_the_synthetic_curves():
    world = curves_world(CURVES, Cluster(system=load_system("h100_80g"), gpus=64), initial_gbs=16,
                         max_gbs=512, target_loss=3.0, segments=60)  # fmt: skip
    result = compare(world, policy_settings(CURVES, 512), world.believed_tokens_per_s)
    assert result.online.time_s < result.static_user.time_s and result.online.time_s < result.ramp.time_s


def test_the_model_error_gives_a_spread_around_the_nominal_comparison():
    world = curves_world(CURVES, Cluster(system=load_system("a6000_48g_pcie"), gpus=16), initial_gbs=16,
                         max_gbs=512, target_loss=3.0, segments=40)  # fmt: skip
    spread = compare_with_error(
        world, policy_settings(CURVES, 512), ModelError(mean=0.05, largest=0.1, draws=6)
    )
    nominal, low, high = spread.speedups(lambda c: c.static_user)
    assert low < high and len(spread.perturbed) == 6
    no_error = compare_with_error(
        world, policy_settings(CURVES, 512), ModelError(mean=0.0, largest=0.0, draws=2)
    )
    assert no_error.speedups(lambda c: c.static_user)[1] == pytest.approx(
        no_error.speedups(lambda c: c.static_user)[0], rel=0.05
    )
    assert nominal == pytest.approx(spread.nominal.static_user.time_s / spread.nominal.online.time_s)


def test_a_switch_in_place_costs_a_step_and_a_layout_change_a_checkpoint_that_shrinks_with_nodes():
    model = ModelConfig(layers=12, hidden=768, heads=12, seq=512, vocab_size=50304)
    a = Strategy(dp=8, tp=1, pp=1, mbs=2, gbs=16)
    assert predicted_switch_cost_s(model, a, a, 8) == 0.0
    assert predicted_switch_cost_s(model, a, Strategy(dp=8, tp=1, pp=1, mbs=4, gbs=32), 8) == IN_PLACE_S
    one_node = predicted_switch_cost_s(model, a, Strategy(dp=4, tp=2, pp=1, mbs=4, gbs=16), 8)
    two_nodes = predicted_switch_cost_s(model, Strategy(dp=16, tp=1, pp=1, mbs=1, gbs=16),
                                        Strategy(dp=8, tp=2, pp=1, mbs=2, gbs=16), 8)  # fmt: skip
    assert one_node > IN_PLACE_S and two_nodes < one_node


def test_a_gbs_whose_run_stopped_above_the_target_is_left_out_and_said_so():
    short = synthetic_curves()
    last = short["curves"][-1]  # gbs 512: keep its first third only
    for key in ("tokens", "eval_loss", "noise_scale"):
        last[key] = last[key][: len(last[key]) // 3]
    curves = parse_curves(short, source="synthetic")
    world = curves_world(curves, Cluster(system=load_system("h100_80g"), gpus=8), initial_gbs=16, max_gbs=512,
                         target_loss=3.0, segments=20)  # fmt: skip
    assert [c.strategy.gbs for c in world.candidates] == [16, 32, 64, 128, 256]
    assert len(world.left_out) == 1 and world.left_out[0].startswith("gbs 512: its run stopped at eval loss")


def test_on_one_gpu_the_online_chain_probes_and_pays_for_each_probe_s_losing_branch():
    """Every candidate keeps the one-GPU layout, so the policy asks for probes; the world answers them, and
    CONA's time is its chain's plus the seconds of every losing branch."""
    world = curves_world(CURVES, Cluster(system=load_system("h100_80g"), gpus=1), initial_gbs=16,
                         max_gbs=512, target_loss=3.0, segments=60)  # fmt: skip
    result = compare(world, policy_settings(CURVES, 512), world.believed_tokens_per_s)
    probed = [record for record in result.decisions if isinstance(record.get("probe"), dict)]
    assert probed and all(record["decision"] in ("switch", "stay") for record in probed)
    times = world.segment_tokens / world.believed_tokens_per_s[None, :]
    lost_s = probes_lost_s(result.decisions)
    assert lost_s > 0
    assert result.online.time_s == pytest.approx(
        chain_time(times, result.online.assignment, world.switch_costs_s) + lost_s
    )
