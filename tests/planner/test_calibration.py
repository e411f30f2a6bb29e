"""Calibration recovers planted factors; measured step times are read from metrics.jsonl rows."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cona.config import ModelConfig, TrainingConfig
from cona.errors import PlanError
from cona.planner.calibration import Calibration, fit_calibration, fit_factors, measurements_from_metrics
from cona.planner.perf_model import predict
from cona.planner.systems import load_system
from cona.strategy import Strategy, StrategyArray

MODEL = ModelConfig(layers=8, hidden=512, heads=8, seq=512, vocab_size=8000)
SYSTEM = load_system("a100_80g_2gpu_node")
DEVICE_BOUND_MODEL = ModelConfig(layers=8, hidden=4096, heads=32, seq=1024, vocab_size=8000)
"""Large enough that the device, not the host's kernel dispatch, sets every step time of the planted fit
(with MODEL most rows are host-bound, and host-bound rows cannot show the communication factor)."""


def test_fit_recovers_planted_factors():
    strategies = [
        Strategy(dp=dp, tp=tp, pp=pp, mbs=mbs, gbs=32)
        for dp, tp, pp in ((1, 1, 1), (4, 1, 1), (2, 2, 1), (1, 4, 1), (2, 1, 2), (8, 1, 1))
        for mbs in (1, 4)
    ]
    planted = Calibration(matrix_efficiency=0.6, comm_efficiency=0.4, overhead_s=0.002)
    times = predict(
        DEVICE_BOUND_MODEL, StrategyArray.from_strategies(strategies), SYSTEM, calibration=planted
    ).iteration_time_s
    fitted = fit_calibration(DEVICE_BOUND_MODEL, list(zip(strategies, times.tolist(), strict=True)), SYSTEM)
    assert fitted.matrix_efficiency == pytest.approx(0.6, rel=0.03)
    assert fitted.memory_efficiency == pytest.approx(1.0, rel=0.05)
    assert fitted.comm_efficiency == pytest.approx(0.4, rel=0.05)
    assert fitted.overhead_s == pytest.approx(0.002, rel=0.1)
    assert fitted.error_before > 0.3 and fitted.error_after < 0.01
    assert fitted.measurements == len(strategies)


def test_matrix_and_memory_factors_are_told_apart_by_models_of_different_sizes():
    """The H200 case (issue 19): the prior's matrix rate too high and its traffic time too long. The share of
    traffic in a step falls as the model grows, so one device factor cannot fit several sizes; two can,
    and fitted on the smallest and the largest model they predict the one between."""
    planted = Calibration(matrix_efficiency=0.85, memory_efficiency=1.4)
    sizes = [(12, 768, 12), (24, 1024, 16), (24, 2048, 16)]
    models = [ModelConfig(layers=n, hidden=h, heads=a, seq=1024, vocab_size=50304) for n, h, a in sizes]
    strategies = [Strategy(dp=1, tp=1, pp=1, mbs=mbs, gbs=mbs) for mbs in (8, 16)]
    h200 = load_system("h200_141g")
    cases = [(model, strategy) for model in models for strategy in strategies]

    def predicted(calibration: Calibration, rows=cases):
        return np.array([predict(m, s, h200, calibration=calibration).iteration_time_s[0] for m, s in rows])

    times = predicted(planted)
    fitted_on, held_out = [0, 1, 4, 5], [2, 3]
    rows = [cases[index] for index in fitted_on]
    fitted = fit_factors(lambda calibration: predicted(calibration, rows), times[fitted_on])
    assert fitted.matrix_efficiency == pytest.approx(0.85, rel=0.03)
    assert fitted.memory_efficiency == pytest.approx(1.4, rel=0.05)
    held = [cases[index] for index in held_out]
    assert np.all(np.abs(predicted(fitted, held) / times[held_out] - 1) < 0.01)
    # No single device factor fits all three sizes within 3%.
    for factor in np.linspace(0.8, 1.25, 46):
        single = Calibration(matrix_efficiency=factor, memory_efficiency=factor)
        assert np.max(np.abs(predicted(single) / times - 1)) > 0.03


def test_unidentifiable_communication_factor_stays_at_one():
    strategy = Strategy(dp=1, tp=1, pp=1, mbs=2, gbs=2)
    measured = 1.5 * predict(MODEL, strategy, SYSTEM).iteration_time_s[0]
    fitted = fit_calibration(MODEL, [(strategy, float(measured))], SYSTEM)
    assert fitted.comm_efficiency == pytest.approx(1.0)
    assert fitted.error_before == pytest.approx(1 - 1 / 1.5, rel=1e-6)
    assert fitted.error_after < 0.01


def test_fit_refuses_no_or_bad_measurements():
    with pytest.raises(PlanError, match="at least one"):
        fit_calibration(MODEL, [], SYSTEM)
    with pytest.raises(PlanError, match="positive"):
        fit_calibration(MODEL, [(Strategy(dp=1, tp=1, pp=1, mbs=1, gbs=1), 0.0)], SYSTEM)


def row(step_time, dp=2, mbs=1, stage=None, **extra):
    return {
        "dp": dp,
        "tp": 1,
        "pp": 1,
        "mbs": mbs,
        "gbs": 8,
        "step_time_s": step_time,
        "stage": stage,
        **extra,
    }


def test_measurements_take_the_median_and_skip_each_stages_first_step(tmp_path):
    rows = [
        row(9.0, stage=0),
        row(1.0, stage=0),
        row(3.0, stage=0),
        {"eval_loss": 2.0},
        row(2.0, stage=0),
        row(7.0, mbs=2, stage=1),
        row(4.0, mbs=2, stage=1),
        row(8.0, stage=2),
        row(5.0, stage=2),
    ]  # back to the first strategy: its first step is skipped again
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    measured = dict(measurements_from_metrics(path))
    assert measured == {
        Strategy(dp=2, tp=1, pp=1, mbs=1, gbs=8): 2.5,
        Strategy(dp=2, tp=1, pp=1, mbs=2, gbs=8): 4.0,
    }
    assert dict(measurements_from_metrics(rows)) == measured


def test_metrics_rows_with_optional_strategy_fields():
    rows = [row(1.0, zero_stage=3, recompute="full"), row(2.0, zero_stage=3, recompute="full")]
    [(strategy, seconds)] = measurements_from_metrics(rows)
    assert (strategy.zero_stage, strategy.recompute, seconds) == (3, "full", 2.0)


def test_bad_metrics_input_is_one_line(tmp_path):
    with pytest.raises(PlanError, match="step_time_s without tp"):
        measurements_from_metrics([{"dp": 1, "pp": 1, "mbs": 1, "gbs": 1, "step_time_s": 1.0}])
    bad = tmp_path / "metrics.jsonl"
    bad.write_text('{"dp": 1}\n{oops\n')
    with pytest.raises(PlanError, match="line 2"):
        measurements_from_metrics(bad)
    with pytest.raises(PlanError, match="does not exist"):
        measurements_from_metrics(tmp_path / "none.jsonl")


def test_strategy_fields_missing_from_rows_come_from_the_training_config():
    training = TrainingConfig(zero_stage=3, recompute="selective", sequence_parallel=True)
    rows = [row(1.0), row(2.0), row(3.0, zero_stage=0), row(4.0, zero_stage=0)]
    strategies = [strategy for strategy, _ in measurements_from_metrics(rows, training=training)]
    assert [(s.zero_stage, s.recompute, s.sequence_parallel) for s in strategies] == [
        (3, "selective", True),
        (0, "selective", True),
    ]
