"""Correct the performance model with measured step times: five factors fitted by least squares.

``matrix_efficiency`` divides the matrix products' arithmetic, ``memory_efficiency`` the memory traffic
(elementwise kernels, operand traffic, optimizer), ``comm_efficiency`` every communication time,
``host_efficiency`` the host's kernel dispatch (the step is ``max(host, device)``), and ``overhead_s`` is a
fixed cost per micro-batch added after it (work that neither overlaps nor is modelled: a synchronising
step, a CPU that computes what it dispatches). Arithmetic and traffic have a factor each because their
shares of a step change with the model's size while their priors miss by different ratios; a single device
factor then fits one size at the cost of the others (docs/perf-model.md, "Calibration"). They are fitted on
the log of predicted/measured step time, so a 10% miss counts the same on a fast and a slow strategy, with a
weak pull towards "no correction" so that few or uninformative measurements (no communication at all, no
host-bound step, say) leave the unidentifiable factors at 1 instead of anywhere.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from scipy.optimize import least_squares

from cona.config import ModelConfig, TrainingConfig
from cona.errors import PlanError
from cona.jsonl import read_lines
from cona.metrics_record import MetricsRecord
from cona.planner.calibration_factors import Calibration
from cona.planner.flops import ModelShape
from cona.planner.perf_model import predict
from cona.planner.systems import System
from cona.strategy import Strategy, StrategyArray

PRIOR_WEIGHTS = (0.05, 0.05, 0.05, 0.05, 1.0)
"""Pull of the log of the matrix, memory, communication and host factors and of overhead/median-step
towards 0, against a log error of 1 per measurement: a 5% miss weighs as much as a factor e off in one of
the rates, or an overhead of 5% of the median step. With too few measurements to tell them apart, a miss
is blamed on the rates (the priors are optimistic) rather than on an overhead, and shared between the
device's two rates in proportion to their terms."""
FACTOR_BOUNDS = (0.02, 50.0)
STRATEGY_KEYS = ("dp", "tp", "pp", "mbs", "gbs")
OPTIONAL_KEYS = ("zero_stage", "recompute", "sequence_parallel", "pipeline_schedule", "virtual_stages")


def relative_errors(predicted: np.ndarray, measured: np.ndarray) -> np.ndarray:
    """``predicted / measured - 1`` per measurement."""
    return np.asarray(predicted, dtype=float) / np.asarray(measured, dtype=float) - 1.0


def fit_calibration(
    model: ModelConfig | ModelShape,
    measured: list[tuple[Strategy, float]],
    system: System,
    dtype: str = "bf16",
    *,
    flash_attention: bool | None = None,
    backend: str = "native",
) -> Calibration:
    """Fit the factors to ``(strategy, measured step seconds)`` pairs of one model, as ``backend``
    runs it."""
    if not measured:
        raise PlanError("calibration needs at least one measured strategy")
    strategies = StrategyArray.from_strategies([strategy for strategy, _ in measured])

    def predicted(calibration: Calibration) -> np.ndarray:
        return predict(
            model,
            strategies,
            system,
            dtype=dtype,
            calibration=calibration,
            flash_attention=flash_attention,
            backend=backend,
        ).iteration_time_s

    return fit_factors(predicted, [seconds for _, seconds in measured])


def fit_factors(predicted: Callable[[Calibration], np.ndarray], measured_s: Sequence[float]) -> Calibration:
    """Fit the factors for any predictor of the measured rows (e.g. rows of several models)."""
    times = np.asarray(measured_s, dtype=float)
    if times.size == 0:
        raise PlanError("calibration needs at least one measured strategy")
    if not np.all(times > 0):
        raise PlanError("calibration: measured step times must be positive")
    scale = float(np.median(times))

    def calibration_of(params: np.ndarray) -> Calibration:
        # Log factors keep efficiencies positive; the overhead is in units of the median step.
        matrix, memory, comm, host = np.exp(params[:4])
        return Calibration(
            matrix_efficiency=float(matrix),
            memory_efficiency=float(memory),
            comm_efficiency=float(comm),
            host_efficiency=float(host),
            overhead_s=float(params[4]) * scale,
        )

    def residuals(params: np.ndarray) -> np.ndarray:
        misses = np.log(predicted(calibration_of(params)) / times)
        return np.concatenate([misses, np.multiply(PRIOR_WEIGHTS, params)])

    low, high = np.log(FACTOR_BOUNDS)
    # The overhead starts just inside its bound: least_squares does not move a variable that starts on one.
    fit = least_squares(
        residuals,
        x0=np.array([0.0, 0.0, 0.0, 0.0, 1e-3]),
        bounds=([low] * 4 + [0.0], [high] * 4 + [1.0]),
        diff_step=1e-4,
    )
    fitted = calibration_of(fit.x)
    before = predicted(Calibration())
    after = predicted(fitted)
    return replace(
        fitted,
        measurements=int(times.size),
        error_before=float(np.mean(np.abs(relative_errors(before, times)))),
        error_after=float(np.mean(np.abs(relative_errors(after, times)))),
    )


def describe(calibration: Calibration) -> str:
    """The factors in one line (for reports)."""
    return (
        f"matrix efficiency {calibration.matrix_efficiency:.3f}, memory {calibration.memory_efficiency:.3f}, "
        f"comm {calibration.comm_efficiency:.3f}, host {calibration.host_efficiency:.3f}, overhead "
        f"{calibration.overhead_s * 1e3:.2f} ms per micro-batch"
    )


def measurements_from_metrics(
    path_or_rows: str | Path | Iterable[MetricsRecord | dict[str, Any]],
    *,
    training: TrainingConfig | None = None,
) -> list[tuple[Strategy, float]]:
    """Median step time of each strategy in a ``metrics.jsonl`` (a path, or its rows already decoded or read
    as records).

    Rows without ``step_time_s`` (evaluation, events) are skipped. The first timed row of each stage is
    dropped: it includes start-up, compilation and warm-up. A stage is a run of consecutive rows with the
    same ``stage`` value (when rows carry one) and the same strategy. Strategy fields a row does not carry
    (zero stage, recompute, ...) come from ``training`` (the run's config) when given, else the defaults.
    """
    rows = _read_rows(path_or_rows) if isinstance(path_or_rows, str | Path) else list(path_or_rows)
    times: dict[Strategy, list[float]] = {}
    previous_stage: tuple | None = None
    for number, row in enumerate(rows, start=1):
        record = _as_record(row, number)
        if record is None or record.step_time_s is None:
            continue
        strategy = _strategy_of(record, number, training)
        stage = (record.stage, strategy)
        if stage != previous_stage:
            previous_stage = stage
            continue
        times.setdefault(strategy, []).append(float(record.step_time_s))
    return [(strategy, statistics.median(values)) for strategy, values in times.items()]


def _read_rows(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.is_file():
        raise PlanError(f"metrics file {path} does not exist")
    rows = []
    for line in read_lines(path):
        if line.error is not None:
            raise PlanError(f"{path}: line {line.number}: not valid JSON: {line.error.msg}")
        rows.append(line.value)
    return rows


def _as_record(row: MetricsRecord | Any, number: int) -> MetricsRecord | None:
    """A row as a record (None for one that is not a JSON object)."""
    if isinstance(row, MetricsRecord):
        return row
    if not isinstance(row, dict):
        return None
    try:
        return MetricsRecord.from_dict(row)
    except ValueError as err:
        raise PlanError(f"metrics row {number}: {err}") from None


def _strategy_of(record: MetricsRecord, number: int, training: TrainingConfig | None) -> Strategy:
    """The row's strategy; the options a metrics line does not carry (zero stage, recompute, ...) from the
    line's extra keys where a tool wrote them, else from ``training``."""
    missing = [key for key in STRATEGY_KEYS if getattr(record, key) is None]
    if missing:
        raise PlanError(f"metrics row {number}: step_time_s without {', '.join(missing)}")
    values = _training_defaults(training)
    values.update({key: getattr(record, key) for key in STRATEGY_KEYS})
    values.update({key: record.extra[key] for key in OPTIONAL_KEYS if record.extra.get(key) is not None})
    try:
        return Strategy(**values)
    except TypeError as err:
        raise PlanError(f"metrics row {number}: {err}") from None


def _training_defaults(training: TrainingConfig | None) -> dict[str, Any]:
    if training is None:
        return {}
    return {
        "zero_stage": training.zero_stage,
        "recompute": training.recompute,
        "sequence_parallel": training.sequence_parallel,
        "pipeline_schedule": training.pipeline_schedule,
        "virtual_stages": training.pipeline_virtual_stages,
    }
