"""The gradient noise scale a run measured so far, read back from its ``metrics.jsonl`` (for adascale and
for an online run's search after a resume)."""

from __future__ import annotations

import json
from pathlib import Path

from cona.config import TrainingConfig
from cona.planner.efficiency import NoiseScaleEstimate, NoiseScaleTracker


def measured_noise_scale(
    run_dir: Path, training: TrainingConfig, up_to_iteration: int
) -> NoiseScaleEstimate | None:
    """The gradient noise scale measured so far (metrics.jsonl up to ``up_to_iteration``), for adascale."""
    return noise_tracker(run_dir, training.base_gbs, up_to_iteration).estimate()


def noise_tracker(run_dir: Path, base_gbs: int, up_to_iteration: int) -> NoiseScaleTracker:
    """The noise-scale tracker fed with metrics.jsonl up to ``up_to_iteration``. A retried stage logs some
    iterations twice: each iteration counts once, its last record."""
    records: dict[int, dict] = {}
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # the line a killed worker was writing
            if isinstance(record.get("iteration"), int) and record["iteration"] <= up_to_iteration:
                records[record["iteration"]] = record
    tracker = NoiseScaleTracker(base_batch=base_gbs)
    for iteration in sorted(records):
        tracker = tracker.update_from_metrics(records[iteration])
    return tracker
