"""Offline planner: the DP optimum against brute force, CONA against the optimum, progress bookkeeping."""

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from cona.config import ConaConfig, ModelConfig, TrainingConfig
from cona.errors import PlanError
from cona.planner.efficiency import NoiseScaleEstimate
from cona.planner.plan import (
    DEFAULT_SEGMENTS,
    NoiseProfile,
    SearchSettings,
    chain_config,
    chain_time,
    noise_profile,
    optimal_assignment,
    plan,
    segment_times,
    simulate,
    space_options,
    target_progress,
)
from cona.planner.policy import Candidate, PolicySettings
from cona.planner.systems import load_system
from cona.planner.trace import LossCurve, read_trace, synthetic_trace
from cona.planner.trace_progress import trace_progress
from cona.runner.chain_file import parse_chain
from cona.strategy import Strategy

GPT_1_3B = ModelConfig(name="gpt-1.3b", layers=24, hidden=2048, heads=16, seq=2048, vocab_size=50257)


def brute_force_time(times: np.ndarray, cost: float) -> float:
    segments, count = times.shape
    return min(
        chain_time(times, np.asarray(chain), cost)
        for chain in itertools.product(range(count), repeat=segments)
    )


@pytest.mark.parametrize("seed", range(6))
def test_dynamic_programming_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    times = rng.uniform(0.5, 2.0, size=(7, 3))
    for cost in (0.0, 0.3, 1.0, 5.0):
        assignment = optimal_assignment(times, cost)
        assert chain_time(times, assignment, cost) == pytest.approx(brute_force_time(times, cost), abs=1e-12)


def test_the_optimum_pays_a_switch_only_when_it_is_worth_it():
    times = np.array([[1.0, 2.0], [1.0, 2.0], [2.0, 1.0], [2.0, 1.0]])
    assert optimal_assignment(times, 1.5).tolist() == [0, 0, 1, 1]  # saves 2, costs 1.5
    assert optimal_assignment(times, 2.5).tolist() == [0, 0, 0, 0]  # saves 2, costs 2.5


def test_progress_is_tokens_at_the_base_batch_and_less_above_it():
    trace = synthetic_trace(seq=2048, gbs=64, total_tokens=1e9, points=100)
    assert trace_progress(trace, 64) == pytest.approx(trace.tokens)
    slower = trace_progress(trace, 32)  # the trace's gbs 64 is above this base: each token is worth less
    assert np.all(slower[1:] < trace.tokens[1:])


def constant_profile(noise_scale: float | None, segments: int = 20, progress: float = 1e6) -> NoiseProfile:
    estimate = (
        None if noise_scale is None else NoiseScaleEstimate(grad_sqr=1.0, trace_sigma=noise_scale, samples=50)
    )
    return NoiseProfile(edges=np.linspace(0, progress, segments + 1), estimates=(estimate,) * segments)


HAND_CANDIDATES = (
    Candidate(strategy=Strategy(dp=4, tp=1, pp=1, mbs=1, gbs=4), predicted_tokens_per_s=100.0),
    Candidate(strategy=Strategy(dp=4, tp=1, pp=1, mbs=2, gbs=8), predicted_tokens_per_s=180.0),
)


def test_static_time_is_progress_over_throughput_times_efficiency():
    result = simulate(
        HAND_CANDIDATES,
        constant_profile(12.0),
        policy=PolicySettings(base_gbs=4, max_gbs=8),
        switch_cost_s=1.0,
        seq=8,
    )
    assert result.static[0].time_s == pytest.approx(1e6 / 100.0)
    assert result.static[1].time_s == pytest.approx(1e6 / (180.0 * (12 + 4) / (12 + 8)))
    assert result.static[1].stages[0].tokens == pytest.approx(1e6 * (12 + 8) / (12 + 4))


def test_online_never_switches_while_the_noise_scale_is_unknown():
    settings = PolicySettings(base_gbs=4, max_gbs=8)
    result = simulate(HAND_CANDIDATES, constant_profile(None), policy=settings, switch_cost_s=0.0, seq=8)
    assert result.online.switches == 0 and result.decisions == ()
    known = simulate(HAND_CANDIDATES, constant_profile(1e4), policy=settings, switch_cost_s=0.0, seq=8)
    assert known.online.switches == 1 and known.decisions[0]["decision"] == "switch"


@pytest.fixture(scope="module")
def reference_plan():
    """GPT 1.3B on the paper's 16 A6000s (2 nodes, 100 GbE), a Kaplan-shaped noise scale, 26B tokens."""
    config = ConaConfig(model=GPT_1_3B, training=TrainingConfig(base_gbs=16))
    trace = synthetic_trace(seq=2048, gbs=16, total_tokens=2.6e10, curve=LossCurve(scale_tokens=2.6e7))
    search = SearchSettings(system=load_system("a6000_48g_pcie"), n_gpus=16, botorch=False)
    policy = PolicySettings(base_gbs=16, max_gbs=1024)
    progress = target_progress(trace, 16, target_loss=2.4)
    return config, plan(
        config, trace, search=search, policy=policy, initial_gbs=16, progress=progress, switch_cost_s=60.0
    )


def test_cona_tracks_the_hindsight_optimum_on_a_reference_shaped_curve(reference_plan):
    _, result = reference_plan
    regret = result.online.time_s / result.optimum.time_s - 1.0
    best_static = result.best_static.time_s / result.optimum.time_s
    print(f"CONA vs hindsight optimum: {regret:+.3%}; best static {best_static:.3f}x the optimum")
    assert result.optimum.switches >= 1  # the scenario rewards chaining at all
    assert result.best_static.time_s > result.optimum.time_s * 1.01
    assert 0.0 <= regret < 0.01  # bench/plan_simulation.py: +0.123% here, worst +0.648% over its scenarios
    assert result.online.time_s < result.best_static.time_s


def test_the_online_chain_is_a_valid_chain_config_covering_the_training(reference_plan):
    config, result = reference_plan
    raw = chain_config(result.online.stages)
    chain = parse_chain(raw, source=None, config=config, world_size=16, dtype="bf16", workdir=Path("."))
    assert [step.gbs for step in chain.steps] == [stage.strategy.gbs for stage in result.online.stages]
    assert chain.steps[0].is_initial and all(step.load_dp is not None for step in chain.steps[1:])
    trained = sum(stage.iterations * stage.strategy.gbs * 2048 for stage in result.online.stages)
    assert trained == pytest.approx(sum(stage.tokens for stage in result.online.stages), rel=1e-3)


def test_a_profile_samples_the_estimate_known_at_each_segment_start():
    trace = synthetic_trace(seq=2048, gbs=64, total_tokens=1e9, points=100, unknown_points=10)
    profile = noise_profile(trace, 64, 1e9, 45)
    # Measurements every 1e7 tokens, the first 10 without an estimate; segments start every 2.2e7 tokens.
    assert all(estimate is None for estimate in profile.estimates[:5])  # starts up to 8.9e7
    assert profile.estimates[5].samples == 11  # starts at 1.11e8: the 11th measurement is the last known
    assert np.all(np.diff(profile.noise_scale[5:]) >= 0)  # the loss falls, so the noise scale grows


def test_a_metrics_trace_gives_the_noise_scale_and_prefers_eval_loss(tmp_path):
    rows = []
    for iteration in range(1, 31):
        rows.append(
            {
                "iteration": iteration,
                "consumed_tokens": iteration * 8 * 16,
                "gbs": 8,
                "loss": 5.0 - iteration * 0.1,
                "gns_small_sqr": 1.0 + 40.0 / 2,  # |G|^2 = 1, tr(Sigma) = 40: noise scale 40 samples
                "gns_big_sqr": 1.0 + 40.0 / 8,
                "gns_small_batch": 2,
                "gns_big_batch": 8,
            }
        )
        if iteration % 10 == 0:
            rows.append({"iteration": iteration, "consumed_tokens": iteration * 8 * 16, "eval_loss": 4.0})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    trace = read_trace(tmp_path, training=TrainingConfig(base_gbs=8))
    assert trace.estimate(5) is None and trace.estimate(6) is not None  # the tracker needs 7 measurements
    assert trace.estimate(29).noise_scale == pytest.approx(40.0)
    assert trace.loss_kind == "eval_loss" and trace.tokens_at_loss(4.0) == 10 * 8 * 16


def test_interleaved_configs_are_refused_with_the_key():
    training = TrainingConfig(pipeline_schedule="interleaved_1f1b", pipeline_virtual_stages=2)
    with pytest.raises(PlanError, match="training.pipeline_schedule"):
        space_options(training)
    assert space_options(TrainingConfig(zero_stage=2)).zero_stages == (2,)


def test_online_goes_past_a_frontier_whose_best_strategy_is_slow():
    slow_middle = (
        HAND_CANDIDATES[0],
        Candidate(strategy=Strategy(dp=4, tp=1, pp=1, mbs=2, gbs=8), predicted_tokens_per_s=90.0),
        Candidate(strategy=Strategy(dp=4, tp=1, pp=1, mbs=4, gbs=16), predicted_tokens_per_s=300.0),
    )
    settings = PolicySettings(base_gbs=4, max_gbs=16)
    result = simulate(slow_middle, constant_profile(1e4), policy=settings, switch_cost_s=0.0, seq=8)
    assert [stage.strategy.gbs for stage in result.online.stages] == [4, 16]


def test_the_planned_optimum_on_a_small_synthetic_trace_is_the_brute_force_one():
    trace = synthetic_trace(seq=8, gbs=4, total_tokens=4e6, points=200, curve=LossCurve(scale_tokens=4e3))
    candidates = (
        *HAND_CANDIDATES,
        Candidate(strategy=Strategy(dp=4, tp=1, pp=1, mbs=4, gbs=16), predicted_tokens_per_s=300.0),
    )
    profile = noise_profile(trace, 4, target_progress(trace, 4), 7)
    settings = PolicySettings(base_gbs=4, max_gbs=16)
    result = simulate(candidates, profile, policy=settings, switch_cost_s=50.0, seq=8)
    times = segment_times(profile, candidates, 4)
    assert result.optimum.time_s == pytest.approx(brute_force_time(times, 50.0), rel=1e-12)
    assert result.optimum.switches >= 1 and result.online.time_s >= result.optimum.time_s


def test_online_decides_no_more_often_than_a_run_logs():
    """A run decides at its metrics lines. On a short trace the segments are fractions of an iteration;
    deciding at each made 1-iteration stages, each paying a checkpointed switch (cona plan on the demo's
    trace: gbs 2, 4 and 8 for one iteration each)."""
    candidates = (
        *HAND_CANDIDATES,
        Candidate(strategy=Strategy(dp=4, tp=1, pp=1, mbs=4, gbs=16), predicted_tokens_per_s=320.0),
    )
    profile = constant_profile(1e4, segments=80, progress=4 * 8 * 20)  # a quarter iteration at gbs 4
    every_segment, every_third = (
        simulate(
            candidates,
            profile,
            policy=PolicySettings(base_gbs=4, max_gbs=16, decision_interval=interval),
            switch_cost_s=0.0,
            seq=8,
        )
        for interval in (1, 3)
    )
    assert [stage.iterations for stage in every_segment.online.stages[:-1]] == [1, 1]
    decided = [record["iteration"] for record in every_third.decisions]
    assert len(decided) == 2 and decided[0] >= 3 and decided[1] - decided[0] >= 3, decided
    assert all(stage.iterations >= 3 for stage in every_third.online.stages[:-1])


def test_the_noise_scale_factor_reads_a_trace_as_one_of_that_many_times_its_noise():
    """``cona plan`` with ``noise_scale_factor`` k on a trace plans as it would with k = 1 on the same trace
    whose noise scale was k times larger: progress, the profile's phi and the chains alike."""
    shape = {"seq": 2048, "gbs": 16, "total_tokens": 2.6e10, "curve": LossCurve(scale_tokens=2.6e7)}
    measured, larger = synthetic_trace(**shape), synthetic_trace(**shape, noise_multiplier=4.0)
    np.testing.assert_allclose(trace_progress(measured, 8, noise_scale_factor=4.0), trace_progress(larger, 8))
    assert not np.allclose(trace_progress(measured, 8), trace_progress(larger, 8))
    progress = target_progress(larger, 16, target_loss=2.4)
    assert target_progress(measured, 16, target_loss=2.4, noise_scale_factor=4.0) == pytest.approx(progress)
    profile = noise_profile(measured, 16, progress, DEFAULT_SEGMENTS, noise_scale_factor=4.0)
    np.testing.assert_allclose(
        profile.noise_scale, noise_profile(larger, 16, progress, DEFAULT_SEGMENTS).noise_scale
    )
    config = ConaConfig(model=GPT_1_3B, training=TrainingConfig(base_gbs=16))
    search = SearchSettings(system=load_system("a6000_48g_pcie"), n_gpus=16, botorch=False)
    results = [
        plan(
            config,
            trace,
            search=search,
            policy=PolicySettings(base_gbs=16, max_gbs=1024, noise_scale_factor=factor),
            initial_gbs=16,
            progress=progress,
            switch_cost_s=60.0,
        )
        for trace, factor in ((measured, 4.0), (larger, 1.0))
    ]
    for chain in ("online", "optimum", "best_static"):
        times = [getattr(result, chain).time_s for result in results]
        assert times[0] == pytest.approx(times[1], rel=1e-9)
