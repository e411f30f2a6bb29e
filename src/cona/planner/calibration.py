"""Measured step times of a run for the calibration: the median step of each strategy in a
``metrics.jsonl``. The fit itself is :func:`cona.planner.step_shape.fit_shape` (the one that ``cona plan``
and the online search use), on the model's terms from :func:`cona.planner.step_parts.model_step_parts`.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from cona.config import TrainingConfig
from cona.errors import PlanError
from cona.jsonl import read_lines
from cona.metrics_record import MetricsRecord
from cona.strategy import Strategy

STRATEGY_KEYS = ("dp", "tp", "pp", "mbs", "gbs")
OPTIONAL_KEYS = ("zero_stage", "recompute", "sequence_parallel", "pipeline_schedule", "virtual_stages")


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
        "zero_stage": training.runtime.zero_stage,
        "recompute": training.runtime.recompute,
        "sequence_parallel": training.runtime.sequence_parallel,
        "pipeline_schedule": training.runtime.pipeline_schedule,
        "virtual_stages": training.runtime.pipeline_virtual_stages,
    }
