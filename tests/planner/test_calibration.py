"""Measured step times for the calibration are read from metrics.jsonl rows (the fit: test_step_shape.py)."""

from __future__ import annotations

import json

import pytest

from cona.config import ModelConfig, TrainingConfig
from cona.errors import PlanError
from cona.planner.calibration import measurements_from_metrics
from cona.planner.systems import load_system
from cona.strategy import Strategy

MODEL = ModelConfig(layers=8, hidden=512, heads=8, seq=512, vocab_size=8000)
SYSTEM = load_system("a100_80g_2gpu_node")
DEVICE_BOUND_MODEL = ModelConfig(layers=8, hidden=4096, heads=32, seq=1024, vocab_size=8000)
"""Large enough that the device, not the host's kernel dispatch, sets every step time of the planted fit
(with MODEL most rows are host-bound, and host-bound rows cannot show the communication factor)."""


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
