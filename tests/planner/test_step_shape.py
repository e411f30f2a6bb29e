"""The calibration on measured steps (fit_shape over the model's terms): it recovers planted factors, tells
the matrix rate from the memory traffic, and leaves what the points cannot show at its neutral value."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cona.config import ModelConfig, TrainingConfig
from cona.errors import PlanError
from cona.planner.calibration_factors import Calibration
from cona.planner.perf_model import predict
from cona.planner.profiles import NATIVE_HOST, run_profile
from cona.planner.step_parts import StepParts, model_step_parts
from cona.planner.step_shape import DEVICE_PRIOR_ERROR, StepShape, fit_shape
from cona.planner.systems import load_system
from cona.strategy import Strategy, StrategyArray

SYSTEM = load_system("a100_80g_2gpu_node")
DEVICE_BOUND_MODEL = ModelConfig(layers=8, hidden=4096, heads=32, seq=1024, vocab_size=8000)
"""Large enough that the device, not the host's kernel dispatch, sets every step time of the planted fit
(host-bound rows cannot show the communication factor)."""
H200 = load_system("h200_141g")
GPT_125M = ModelConfig(layers=12, hidden=768, heads=12, seq=512, vocab_size=50257)
GPT_SIZES = [(12, 768, 12), (24, 1024, 16), (24, 2048, 16)]


def test_model_parts_add_up_to_the_models_device_time_and_host_dispatch():
    strategies = [
        Strategy(dp=1, tp=1, pp=1, mbs=8, gbs=8),
        Strategy(dp=1, tp=1, pp=1, mbs=8, gbs=16),
        Strategy(dp=2, tp=2, pp=2, mbs=2, gbs=16),
    ]
    parts = model_step_parts(GPT_125M, strategies, H200)
    prediction = predict(GPT_125M, StrategyArray.from_strategies(strategies), H200)
    assert np.allclose(parts.raw_step_s, prediction.iteration_time_s)
    assert np.all(parts.matrix_s > 0) and np.all(parts.memory_s > 0)
    assert parts.comm_s[0] == 0 and parts.comm_s[2] > 0
    assert np.allclose(parts.micro_batches, [1.0, 2.0, 2.0])
    # Each part is what its calibration factor divides inside the model.
    calibration = Calibration(matrix_efficiency=0.8, memory_efficiency=1.3, comm_efficiency=0.5)
    shape = StepShape(form="overlap", matrix_efficiency=0.8, memory_efficiency=1.3, comm_efficiency=0.5)
    calibrated = predict(GPT_125M, StrategyArray.from_strategies(strategies), H200, calibration=calibration)
    assert np.allclose(shape.step_s(parts), calibrated.iteration_time_s, rtol=1e-3)


def test_fit_recovers_planted_factors():
    """Planted in the model's kernels, recovered from its terms. ZeRO 0: its all-reduce is exposed, as the
    native engine's TP collectives are; an overlapped collective's exposed part does not scale with the
    communication factor alone, and there the terms are a first-order split (docs/perf-model.md)."""
    strategies = [
        Strategy(dp=dp, tp=tp, pp=pp, mbs=mbs, gbs=32, zero_stage=0)
        for dp, tp, pp in ((1, 1, 1), (4, 1, 1), (2, 2, 1), (1, 4, 1), (2, 1, 2), (8, 1, 1))
        for mbs in (1, 4)
    ]
    planted = Calibration(matrix_efficiency=0.6, memory_efficiency=0.6, comm_efficiency=0.4)
    array = StrategyArray.from_strategies(strategies)
    times = predict(DEVICE_BOUND_MODEL, array, SYSTEM, calibration=planted).iteration_time_s
    parts = model_step_parts(DEVICE_BOUND_MODEL, strategies, SYSTEM)
    fitted = fit_shape(parts, times)
    assert fitted.matrix_efficiency == pytest.approx(0.6, rel=0.03)
    assert fitted.memory_efficiency == pytest.approx(0.6, rel=0.05)
    assert fitted.comm_efficiency == pytest.approx(0.4, rel=0.05)
    assert np.mean(np.abs(parts.raw_step_s / times - 1)) > 0.3 and fitted.error < 0.01


def test_matrix_and_memory_factors_are_told_apart_by_models_of_different_sizes():
    """The H200's case: the prior's matrix rate too high and its traffic time too long. The share of
    traffic in a step falls as the model grows, so one device factor cannot fit several sizes; two can,
    and fitted on the smallest and the largest model they predict the one between."""
    planted = Calibration(matrix_efficiency=0.85, memory_efficiency=1.4)
    models = [ModelConfig(layers=n, hidden=h, heads=a, seq=1024, vocab_size=50304) for n, h, a in GPT_SIZES]
    strategies = [Strategy(dp=1, tp=1, pp=1, mbs=mbs, gbs=mbs) for mbs in (8, 16)]
    parts = StepParts.concat([model_step_parts(model, strategies, H200) for model in models])
    times = np.array(
        [predict(m, s, H200, calibration=planted).iteration_time_s[0] for m in models for s in strategies]
    )
    fitted_on, held_out = [0, 1, 4, 5], [2, 3]
    fitted = fit_shape(parts.take(fitted_on), times[fitted_on])
    assert fitted.matrix_efficiency == pytest.approx(0.85, rel=0.03)
    assert fitted.memory_efficiency == pytest.approx(1.4, rel=0.05)
    assert np.all(np.abs(fitted.step_s(parts.take(held_out)) / times[held_out] - 1) < 0.01)
    # No single device factor fits all three sizes within 3%.
    for factor in np.linspace(0.8, 1.25, 46):
        assert np.max(np.abs(parts.device_s / factor / times - 1)) > 0.03


def test_unidentifiable_factors_stay_neutral():
    """One GPU has no communication and device-bound steps show no host: the communication factor stays
    at the device's level, the host factor at 1."""
    model = ModelConfig(layers=24, hidden=2048, heads=16, seq=1024, vocab_size=50304)
    strategies = [Strategy(dp=1, tp=1, pp=1, mbs=mbs, gbs=mbs) for mbs in (4, 8, 16)]
    parts = model_step_parts(model, strategies, H200)
    fitted = fit_shape(parts, 1.2 * parts.raw_step_s)
    assert fitted.host_efficiency == pytest.approx(1.0, abs=1e-3)
    level = np.sqrt(fitted.matrix_efficiency * fitted.memory_efficiency)
    assert fitted.comm_efficiency == pytest.approx(level, rel=1e-3)
    assert fitted.error < 0.005


def test_one_point_under_the_model_s_host_floor_corrects_the_host_and_not_the_device():
    """Compiled GPT-125M on the H200 (CUDA graphs): gbs 8 steps in 14.6 ms, under the model's host floor
    (16.6 ms) and over its device (11.4 ms); gbs 16 measures 19.9 ms and gbs 32 about 36 ms. One factor on
    the whole step would make gbs 16 16.9 ms (17.5% fast)."""
    model = ModelConfig(layers=12, hidden=768, heads=12, seq=512, vocab_size=50257)
    strategies = [Strategy(dp=1, tp=1, pp=1, mbs=mbs, gbs=mbs) for mbs in (8, 16, 32)]
    parts = model_step_parts(model, strategies, H200)
    assert parts.device_s[0] < 0.0146 < parts.host_s[0]
    fitted = fit_shape(parts.take(0), [0.0146])
    assert fitted.form == "overlap" and fitted.matrix_efficiency == fitted.memory_efficiency == 1.0
    predicted = fitted.step_s(parts)
    assert predicted[0] == pytest.approx(0.0146)
    assert predicted[1] == pytest.approx(0.0199, rel=0.05) and predicted[2] == pytest.approx(0.036, rel=0.05)
    # Under its device too (under both terms), one point gives one factor on the whole step.
    assert fit_shape(parts.take(0), [0.5 * float(parts.device_s[0])]).form == "scale"


def test_one_point_over_an_eager_host_floor_corrects_the_host_and_not_the_device():
    """Eager GPT-125M on the H200: gbs 16 steps in 39-42 ms on a slow host, over the model's host floor
    (29.8 ms) and its device (26.6 ms); gbs 32 measures 50.1 ms, about its device's 48.0 ms. One factor on
    the whole step would make gbs 32 63-68 ms (0.79 of its measured rate). The host prior is
    :data:`NATIVE_HOST`'s, the one whose floor sits under the measured step."""
    strategies = [Strategy(dp=1, tp=1, pp=1, mbs=mbs, gbs=mbs) for mbs in (8, 16, 32)]
    profile = dataclasses.replace(run_profile("native", TrainingConfig(compile=False)), host=NATIVE_HOST)
    parts = model_step_parts(GPT_125M, strategies, H200, backend=profile)
    assert parts.device_s[1] < parts.host_s[1] < 0.042
    fitted = fit_shape(parts.take(1), [0.042])
    assert fitted.form == "overlap" and fitted.matrix_efficiency == fitted.memory_efficiency == 1.0
    predicted = fitted.step_s(parts)
    assert predicted[1] == pytest.approx(0.042)
    assert predicted[2] == pytest.approx(0.0501, rel=0.05)


def test_one_point_well_over_a_device_bound_step_with_a_host_floor_near_it_corrects_the_host():
    """Eager GPT-125M on an H100 with its own system file: gbs 16 steps in 36.8-39.9 ms, over the model's
    device (32.1 ms; its kernels take 29.9 ms) and host floor (29.8 ms); gbs 8 measures 45-50 ms a step and
    gbs 32 56.5 ms. With the device corrected, gbs 8 would keep the 29.8 ms host floor and gbs 32 take 72 ms
    (0.78 of its measured rate). The host prior is :data:`NATIVE_HOST`'s; with the eager one, the point falls
    under the host floor and moves the host alone (below)."""
    strategies = [Strategy(dp=1, tp=1, pp=1, mbs=mbs, gbs=mbs) for mbs in (8, 16, 32)]
    profile = dataclasses.replace(run_profile("native", TrainingConfig(compile=False)), host=NATIVE_HOST)
    parts = model_step_parts(GPT_125M, strategies, load_system("h100_80g"), backend=profile)
    assert parts.host_s[1] < parts.device_s[1] < 0.0399 * (1 - DEVICE_PRIOR_ERROR)
    fitted = fit_shape(parts.take(1), [0.0399])
    assert fitted.matrix_efficiency == fitted.memory_efficiency == 1.0
    predicted = fitted.step_s(parts)
    assert predicted[0] == pytest.approx(0.0399) and predicted[1] == pytest.approx(0.0399)
    assert predicted[2] == pytest.approx(0.0565, rel=0.05)
    assert fit_shape(parts.take(1), [0.0368]).host_efficiency == pytest.approx(
        float(parts.host_s[1]) / 0.0368
    )
    # Within the device's prior error of it, the point still moves the device (the model's bounding term).
    within = fit_shape(parts.take(1), [float(parts.device_s[1]) * 1.05])
    assert within.host_efficiency == 1.0 and within.matrix_efficiency < 1.0
    eager = model_step_parts(
        GPT_125M,
        strategies,
        load_system("h100_80g"),
        backend=run_profile("native", TrainingConfig(compile=False)),
    )
    assert eager.device_s[1] < 0.0399 < eager.host_s[1]
    predicted = fit_shape(eager.take(1), [0.0399]).step_s(eager)
    assert predicted[0] == pytest.approx(0.0399) and predicted[2] == pytest.approx(0.0565, rel=0.05)


def test_one_point_over_the_model_s_host_floor_on_a_device_bound_step_corrects_the_device():
    """Where the model says the device bounds the step and the point ran over the host floor, only the
    device's factors move: a strategy the host bounds keeps the model's host floor."""
    parts = StepParts.of(matrix_s=[0.02, 0.004], memory_s=[0.01, 0.002], host_s=[0.005, 0.005])
    fitted = fit_shape(parts.take(0), [0.045])
    assert fitted.host_efficiency == 1.0 and fitted.matrix_efficiency == pytest.approx(0.03 / 0.045)
    assert fitted.step_s(parts) == pytest.approx([0.045, 0.009])


def test_one_point_under_both_terms_gives_one_factor_and_bad_input_is_refused():
    parts = StepParts.of(matrix_s=[0.01], memory_s=[0.01], host_s=[0.005])
    single = fit_shape(parts, [0.004])
    assert single.form == "scale" and single.step_s(parts)[0] == pytest.approx(0.004)
    assert fit_shape(StepParts.of(matrix_s=[]), []).form == "model"
    with pytest.raises(PlanError, match="positive"):
        fit_shape(StepParts.of(matrix_s=[1.0, 1.0]), [0.0, 1.0])
    with pytest.raises(PlanError, match="differ in length"):
        fit_shape(StepParts.of(matrix_s=[1.0, 1.0]), [1.0])


@pytest.mark.parametrize("first_free", [0, 3])
@pytest.mark.parametrize("form", ["overlap", "serial"])
def test_the_fits_jacobian_is_the_residuals_derivative(form, first_free):
    """The fit runs beside training on every new rate, so it takes the exact Jacobian (a numerical one made a
    refit seconds of CPU); a wrong column would stop it short of the minimum."""
    from scipy.optimize._numdiff import approx_derivative

    from cona.planner.step_shape import _LogMisses

    strategies = [
        Strategy(dp=1, tp=1, pp=1, mbs=mbs, gbs=gbs) for mbs, gbs in ((1, 8), (4, 8), (8, 32), (16, 64))
    ]
    parts = model_step_parts(GPT_125M, strategies, H200)
    times = parts.raw_step_s * np.array([1.4, 2.5, 1.1, 0.9])
    problem = _LogMisses(form, parts, times, float(np.median(times)), first_free=first_free)
    rng = np.random.default_rng(0)
    for _ in range(5):
        params = np.concatenate([rng.normal(0.0, 1.0, 4), rng.uniform(0.0, 0.5, 2)])[first_free:]
        numeric = approx_derivative(problem.residuals, params, method="3-point")
        assert np.allclose(problem.jacobian(params), numeric, rtol=1e-5, atol=1e-7)
