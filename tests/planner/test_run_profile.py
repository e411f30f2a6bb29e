"""The profile follows the run: CUDA graphs' host dispatch only where the run captures graphs."""

from __future__ import annotations

import dataclasses

import numpy as np

from cona.config import ConaConfig, ModelConfig, TrainingConfig
from cona.planner.profiles import EAGER_DEVICE_FACTOR, EAGER_HOST, NATIVE_HOST, BackendProfile, run_profile
from cona.planner.step_parts import model_step_parts
from cona.planner.systems import load_system
from cona.planner.throughput import Point, ThroughputEstimator
from cona.runner.schedules.frontier import FrontierSearch
from cona.strategy import Strategy

GPT_125M = ModelConfig(name="gpt-125m", layers=12, hidden=768, heads=12, seq=512, vocab_size=50304)
H200_EAGER_TOKENS_PER_S = {8: 109_338, 16: 209_946, 32: 324_866, 64: 357_357}
"""GPT-125M, seq 512, bf16, eager, one H200: medians of an online run's metrics lines."""


def one_gpu(gbs: int) -> Strategy:
    return Strategy(dp=1, tp=1, pp=1, mbs=gbs, gbs=gbs)


def raw_over_measured(profile: BackendProfile, sizes: tuple[int, ...]) -> np.ndarray:
    """The unfitted model's tokens/s of one-GPU gbs ``sizes`` on the H200 over its measured eager rates."""
    h200 = load_system("h200_141g")
    parts = [model_step_parts(GPT_125M, [one_gpu(g)], h200, "bf16", backend=profile) for g in sizes]
    predicted = [g * GPT_125M.seq / float(p.raw_step_s[0]) for g, p in zip(sizes, parts, strict=True)]
    return np.array(predicted) / np.array([H200_EAGER_TOKENS_PER_S[g] for g in sizes])


def test_graphs_only_where_the_run_compiles_on_the_gpu_with_them_on() -> None:
    assert run_profile("native", TrainingConfig()).graph_host is not None  # compiled on CUDA by default
    assert run_profile("native", TrainingConfig(compile=False)).graph_host is None
    assert run_profile("native", TrainingConfig(cuda_graphs=False)).graph_host is None
    assert run_profile("megatron-deepspeed", TrainingConfig()).graph_host is None


def test_the_online_frontier_predicts_an_eager_run_with_the_plain_host_dispatch() -> None:
    h200 = load_system("h200_141g")
    compiled = ConaConfig(model=GPT_125M, training=TrainingConfig(device="cuda"))
    eager = dataclasses.replace(compiled, training=compiled.training.replace(compile=False))
    graphs = FrontierSearch(config=compiled, system=h200, n_gpus=1, dtype="bf16", botorch=False)
    plain = FrontierSearch(config=eager, system=h200, n_gpus=1, dtype="bf16", botorch=False)
    gbs8 = one_gpu(8)
    assert plain.model_step(gbs8).host_s[0] > 1.5 * graphs.model_step(gbs8).host_s[0]
    assert plain.predicted_tokens_per_s(gbs8) < 0.7 * graphs.predicted_tokens_per_s(gbs8)
    assert plain.estimator.forms == graphs.estimator.forms == ("overlap",)  # the engine never syncs in a step


def test_one_eager_point_predicts_the_larger_batches_with_the_runs_profile() -> None:
    """Fitted on the measured gbs 8 alone: the graph profile's device is the compiled kernels', and with its
    host floor corrected to the eager step it over-predicts gbs 32 and 64 by a third or more (one factor on
    the whole step had under-predicted them by a third); the run's own profile keeps them within 20%."""
    h200 = load_system("h200_141g")
    larger = [16, 32, 64]

    def misses(training: TrainingConfig) -> np.ndarray:
        profile = run_profile("native", training)
        parts = {
            g: model_step_parts(GPT_125M, [one_gpu(g)], h200, "bf16", backend=profile) for g in (8, *larger)
        }
        point = Point(strategy=one_gpu(8), tokens_per_s=H200_EAGER_TOKENS_PER_S[8], model=parts[8])
        estimator = ThroughputEstimator(seq=GPT_125M.seq).with_point(point)
        predicted = [estimator.estimate(one_gpu(g), parts[g]).tokens_per_s for g in larger]
        return np.array(predicted) / np.array([H200_EAGER_TOKENS_PER_S[g] for g in larger]) - 1

    assert np.all(np.abs(misses(TrainingConfig(compile=False))) < 0.2)
    assert np.any(misses(TrainingConfig()) > 0.3)


def test_an_eager_gpu_run_is_predicted_at_eager_kernel_speed() -> None:
    """Nothing measured: the eager profile's device time puts the device-bound gbs 32 and 64 within 10% of
    the H200's eager rates; the compiled kernels' times alone put them 1.18-1.42x too fast (gbs 32 then
    meets the eager host floor)."""
    cpu = load_system("cpu_gloo")
    eager = run_profile("native", TrainingConfig(compile=False))
    assert eager.device_time_factor == EAGER_DEVICE_FACTOR

    assert np.all(np.abs(raw_over_measured(eager, (32, 64)) - 1) < 0.1)
    assert np.all(raw_over_measured(dataclasses.replace(eager, device_time_factor=1.0), (32, 64)) > 1.15)
    assert run_profile("native", TrainingConfig()).device_time_factor == 1.0  # compiled on the GPU
    assert run_profile("megatron-deepspeed", TrainingConfig(compile=False)).device_time_factor == 1.0
    # A CPU system's file is measured eager: the factor leaves its steps as they were.
    tiny = ModelConfig(name="tiny", layers=2, hidden=64, heads=4, seq=32, vocab_size=256)
    steps = [
        model_step_parts(tiny, [one_gpu(4)], cpu, "fp32", backend=profile).raw_step_s[0]
        for profile in (eager, dataclasses.replace(eager, device_time_factor=1.0))
    ]
    assert steps[0] == steps[1]


def test_an_eager_gpu_run_is_predicted_at_the_eager_hosts_dispatch() -> None:
    """Nothing measured: the eager host floor puts the host-bound gbs 8 and 16 within 15% of the H200's eager
    rates (the first trial of an eager run is predicted from it); the compiled dispatch puts them 1.2x or
    more too fast."""
    eager = run_profile("native", TrainingConfig(compile=False))
    assert eager.host == EAGER_HOST
    assert np.all(np.abs(raw_over_measured(eager, (8, 16)) - 1) < 0.15)
    assert np.all(raw_over_measured(dataclasses.replace(eager, host=NATIVE_HOST), (8, 16)) > 1.2)
