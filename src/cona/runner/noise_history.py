"""The gradient noise scale a run measured so far, read back from its ``metrics.jsonl`` (for adascale and
for an online run's search after a resume)."""

from __future__ import annotations

from pathlib import Path

from cona import run_files
from cona.config import TrainingConfig
from cona.metrics_record import MetricsRecord, read_metrics
from cona.planner.efficiency import NoiseScaleEstimate, NoiseScaleTracker


def measured_noise_scale(
    run_dir: Path, training: TrainingConfig, up_to_iteration: int
) -> NoiseScaleEstimate | None:
    """The gradient noise scale measured so far (metrics.jsonl up to ``up_to_iteration``), for adascale."""
    return noise_tracker(run_dir, training.lr.base_gbs, up_to_iteration).estimate()


def noise_tracker(run_dir: Path, base_gbs: int, up_to_iteration: int) -> NoiseScaleTracker:
    """The noise-scale tracker fed with metrics.jsonl up to ``up_to_iteration``. A retried stage logs some
    iterations twice: each iteration counts once, its last record."""
    records: dict[int, MetricsRecord] = {}
    for record in read_metrics(run_files.metrics_path(run_dir)):  # not the line a killed worker was writing
        if isinstance(record.iteration, int) and record.iteration <= up_to_iteration:
            records[record.iteration] = record
    tracker = NoiseScaleTracker(base_batch=base_gbs)
    for iteration in sorted(records):
        tracker = tracker.update_from_metrics(records[iteration])
    return tracker
