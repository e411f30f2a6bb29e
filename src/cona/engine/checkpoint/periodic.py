"""Periodic checkpoints inside a stage, so a killed stage resumes from its newest one instead of its start.

A stage saves every ``save_interval`` iterations and/or every ``save_interval_minutes`` (rank 0's clock
decides, and the per-step broadcast of the switch flag carries its decision, so every rank saves at the
same step). The save is asynchronous: DCP copies the state to host memory and a thread writes the shards
while training goes on, agreeing over a gloo group of its own (made at the first save), never over
training's groups. At most one save is in flight: the next one, a switch and the end of the stage first
finish it. Finishing (checksums, manifest, the rename into place and ``latest``) is collective and happens
at the first step boundary after rank 0's shards are written, so the checkpoint is published about as soon
as it is on disk; until then a kill leaves only a temporary that is never loaded.

Each periodic checkpoint's ``trainer_state`` says ``"periodic": true`` with the stage and the run (the owner
tag of its run directory); once a newer one is published, rank 0 removes this stage's older periodic
checkpoints of the same run beyond the newest ``training.keep_checkpoints``, never the one the stage loaded
nor the one ``latest`` names. The final save of a stage stays synchronous and is never removed here.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from cona.engine.checkpoint.files import TRAINER_STATE_FILE
from cona.engine.checkpoint.info import LATEST, STEP_DIR, resolve_checkpoint
from cona.engine.checkpoint.paths import RUN_KEY
from cona.engine.checkpoint.save import PendingSave, remove_checkpoint
from cona.errors import CheckpointError

PERIODIC_KEY = "periodic"


@dataclass(kw_only=True)
class PeriodicSaves:
    """When a stage saves between its start and its end, and the one save in flight."""

    every_iterations: int | None
    every_seconds: float | None
    keep: int
    start: Callable[..., PendingSave]
    """``start(progress, writer_group=G)``: collective, starts a background save of the current state."""
    layout_dir: Path
    stage: int
    owner: str
    """The run's owner tag (:func:`cona.engine.checkpoint.paths.tmp_owner`): only its own checkpoints are
    pruned."""
    loaded: Path | None = None
    """The checkpoint the stage started from: never pruned."""
    timeout_minutes: float = 10.0
    started_at: float = field(default_factory=time.monotonic)
    pending: PendingSave | None = None
    writer_group: dist.ProcessGroup | None = None

    def due_by_time(self) -> bool:
        """Rank 0's clock says a save is due (the caller broadcasts it)."""
        return self.every_seconds is not None and time.monotonic() - self.started_at >= self.every_seconds

    def due(self, iteration: int, *, by_time: bool) -> bool:
        return by_time or (self.every_iterations is not None and iteration % self.every_iterations == 0)

    def pending_written(self) -> bool:
        """Rank 0's shards of the save in flight are on disk (so the others' nearly are too)."""
        return self.pending is not None and self.pending.written()

    def begin(self, progress: object) -> None:
        """Collective: finish the save in flight, then start one of the state at ``progress``."""
        self.finish()
        if self.writer_group is None:
            timeout = timedelta(minutes=self.timeout_minutes)
            self.writer_group = dist.new_group(backend="gloo", timeout=timeout)
        self.pending = self.start(progress, writer_group=self.writer_group)
        self.started_at = time.monotonic()

    def finish(self) -> Path | None:
        """Collective: wait for the save in flight, publish it and prune (rank 0); returns its path."""
        if self.pending is None:
            return None
        pending, self.pending = self.pending, None
        path = pending.finish()
        if dist.get_rank() == 0:
            prune_periodic(self.layout_dir, stage=self.stage, owner=self.owner, keep=self.keep,
                           spare=self.loaded)  # fmt: skip
        return path

    def close(self) -> None:
        """Collective: finish the save in flight and leave the writer group."""
        self.finish()
        if self.writer_group is not None:
            dist.destroy_process_group(self.writer_group)
            self.writer_group = None


def prune_periodic(layout_dir: Path, *, stage: int, owner: str, keep: int, spare: Path | None) -> list[Path]:
    """Remove stage ``stage``'s periodic checkpoints of run ``owner`` in ``layout_dir`` beyond the newest
    ``keep``, except ``spare`` and the one ``latest`` names; returns those removed."""
    protected = {_resolved(spare), _resolved(layout_dir / LATEST)} - {None}
    periodic: list[tuple[int, Path]] = []
    for path in layout_dir.iterdir():
        match = STEP_DIR.fullmatch(path.name)
        if match is None or match.group(2) or not path.is_dir():
            continue  # universal copies are published ones, never periodic
        try:
            state = json.loads((path / TRAINER_STATE_FILE).read_text())
        except (OSError, json.JSONDecodeError):
            continue  # not complete: not one of ours to prune
        if not isinstance(state, dict):
            continue
        if state.get(PERIODIC_KEY) is True and state.get("stage") == stage and state.get(RUN_KEY) == owner:
            periodic.append((int(match.group(1)), path))
    removed = []
    for _, path in sorted(periodic, reverse=True)[keep:]:
        if path.resolve() not in protected:
            remove_checkpoint(path, owner)
            removed.append(path)
    return removed


def _resolved(path: Path | None) -> Path | None:
    if path is None:
        return None
    try:
        return resolve_checkpoint(path).resolve()
    except CheckpointError:
        return None
