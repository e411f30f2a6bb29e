"""Saving a checkpoint (:mod:`cona.engine.checkpoint` says what it holds): collective, crash-safe.

Crash safety comes from the order of writes: shards, JSON and the manifest go to
``.tmp-global_step<N>-<id>``, which rank 0 renames to ``global_step<N>`` once every rank finished; only then
is the ``latest`` marker replaced (itself through a temporary file and a rename). A kill at any point leaves
``latest`` naming either the previous checkpoint or the complete new one; leftover ``.tmp-*`` entries are
never loaded and are removed by the next save of the same run (they end in ``-of-<owner>``, a digest of the
run directory: another run's save in progress in the same folder is left alone). A re-save of an existing
iteration swaps the two directories atomically where the OS can (:func:`_publish`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from cona.atomic_files import fsync_dir, write_atomic, write_json_atomic
from cona.config import ConaConfig
from cona.engine.checkpoint.dcp import dcp_async_save, dcp_save, failure_line
from cona.engine.checkpoint.files import (
    CONFIG_FILE,
    TRAINER_STATE_FILE,
    exchange_paths,
)
from cona.engine.checkpoint.info import (
    LATEST,
    PROBE_FILE,
    STRATEGY_FILE,
    model_shape,
)
from cona.engine.checkpoint.manifest import (
    checksum,
    present_files,
    shares,
    write_manifest,
)
from cona.engine.checkpoint.paths import (
    OWNER_TAG,
    TMP_PREFIX,
    another_runs_checkpoint,
    is_own_tmp,
    tmp_name,
)
from cona.engine.checkpoint.state import (
    barrier,
    distributed,
    gather,
    model_and_optimizer_state,
    rank,
    world_size,
)
from cona.errors import CheckpointError
from cona.strategy import Strategy

# ----------------------------------------------------------------------------------------------- save


def save_checkpoint(layout_dir: Path, **save: Any) -> Path:
    """Collective: save model and optimizer state as ``<layout_dir>/global_step<iteration>`` with its
    checksum manifest and point ``latest`` at it (:func:`start_checkpoint` with the files written here and
    now; the keywords are its)."""
    return start_checkpoint(layout_dir, **save).finish()


@dataclass(kw_only=True)
class PendingSave:
    """A checkpoint whose shards are being written; :meth:`finish` (collective) completes and publishes it."""

    final_dir: Path
    files_written: Future | None
    """DCP's future of a background write (None: the shards are written already)."""
    complete: Callable[[], None]
    tmp_dir: Path | None = None
    """The temporary the shards go to: removed when the save fails."""

    def written(self) -> bool:
        """Whether this rank's shards are on disk (finishing then waits for nothing but the others)."""
        return self.files_written is None or self.files_written.done()

    def finish(self) -> Path:
        with _save_failures(self.final_dir, self.tmp_dir):
            if self.files_written is not None:
                try:
                    self.files_written.result()
                except CheckpointException as err:
                    raise failure_line(err, f"saving checkpoint {self.final_dir} failed") from None
            self.complete()
        barrier()
        return self.final_dir


def start_checkpoint(
    layout_dir: Path,
    *,
    iteration: int,
    model_parts: list[nn.Module],
    optimizer: torch.optim.Optimizer,
    trainer_state: dict,
    config: ConaConfig,
    strategy: Strategy,
    probe: dict | None = None,
    owner: str = "",
    background: bool = False,
    writer_group: dist.ProcessGroup | None = None,
    move_latest: bool = True,
) -> PendingSave:
    """Collective: start saving model and optimizer state as ``<layout_dir>/global_step<iteration>``, with
    ``probe`` (a :class:`cona.engine.switch_check.ProbeRecord` as a dict) beside it when given. Also works
    without a process group (one process). A failure on any rank is one :class:`CheckpointError` line with
    its cause. ``owner`` tags the save's temporaries (:func:`tmp_owner` of the run directory): a save
    removes only stale temporaries of its own owner, never another run's save in progress.
    ``background``: the shards are copied to host memory now and written by a thread, which agrees over
    ``writer_group`` (DCP ``async_save``; a gloo group of its own, so it never interleaves with training's
    collectives); else they are written before this returns. Nothing is published before
    :meth:`PendingSave.finish`: the checksums, the manifest, the rename into place and ``latest`` (left where
    it is when not ``move_latest``: a state no rerun is to resume from)."""
    layout_dir = Path(layout_dir)
    final_dir = layout_dir / f"global_step{iteration}"
    with _save_failures(final_dir):
        tmp_dir = layout_dir / _agree_on_tmp_name(layout_dir, iteration, owner)
    with _save_failures(final_dir, tmp_dir):
        model_state, optim_state = model_and_optimizer_state(model_parts, optimizer)
        state = {"model": model_state, "optim": optim_state}
        files_written = None
        if background:
            assert writer_group is not None or not distributed()  # never over training's own groups
            files_written = dcp_async_save(state, tmp_dir, group=writer_group, distributed=distributed())
        else:
            dcp_save(state, tmp_dir, distributed=distributed(), what=f"saving checkpoint {final_dir}")
        tied = _gather_tied_groups(model_parts)
    fields = {
        "iteration": iteration,
        "model_shape": model_shape(config.model),
        "tied_parameters": tied,
        "model_tensors": sorted(model_state),
        "optimizer_tensors": sorted(optim_state),
    }
    documents = _documents(trainer_state, config, strategy, probe)

    def complete() -> None:
        barrier()
        files = _checksums_of_shards(tmp_dir, final_dir)
        if rank() == 0:
            _write_json_files(tmp_dir, documents)
            files.update({n: checksum(tmp_dir / n) for n in present_files(tmp_dir) if n not in files})
            write_manifest(tmp_dir, fields, files)  # before the rename: a published checkpoint has one
            _publish(tmp_dir, final_dir)
            if move_latest:
                _write_marker(layout_dir / LATEST, final_dir.name, owner)

    return PendingSave(final_dir=final_dir, files_written=files_written, complete=complete, tmp_dir=tmp_dir)


def _documents(trainer_state: dict, config: ConaConfig, strategy: Strategy, probe: dict | None) -> dict:
    """The JSON files a checkpoint holds beside its shards."""
    return {
        TRAINER_STATE_FILE: trainer_state,
        CONFIG_FILE: config.to_dict(),
        STRATEGY_FILE: dataclasses.asdict(strategy),
    } | ({PROBE_FILE: probe} if probe is not None else {})


@contextlib.contextmanager
def _save_failures(final_dir: Path, tmp_dir: Path | None = None) -> Iterator[None]:
    """A failed save as one line with its cause and the path; rank 0 then removes ``tmp_dir``, so a failed
    save holds no space. A disk that is full (:func:`_out_of_space`) is said so, with the bytes free,
    whatever the library that hit it reported (torch's writer says ``unexpected pos`` of a short write)."""
    try:
        yield
    except (OSError, CheckpointError) as err:
        free = _free_bytes(final_dir.parent)
        if tmp_dir is not None and rank() == 0:
            _remove(tmp_dir)
        failed = f"saving checkpoint {final_dir} failed"
        cause = str(err) if isinstance(err, CheckpointError) else f"{failed} on rank {rank()}: {err}"
        if _out_of_space(err, free):
            where = f"no space left on {final_dir.parent} ({free} bytes free)"
            cause = f"{failed}: {where}; {cause.removeprefix(failed).lstrip()}"
        raise CheckpointError(cause) from None


LOW_SPACE_BYTES = 64 * 2**20
"""Free bytes on a checkpoint's filesystem below which a failed save is reported as a full disk: the
failing write took the rest (a small save fails with a few KiB left)."""


def _out_of_space(err: BaseException, free: int | None) -> bool:
    """Whether a save failed for want of space: ENOSPC, or a failure with under :data:`LOW_SPACE_BYTES`
    free."""
    enospc = isinstance(err, OSError) and err.errno == errno.ENOSPC
    return enospc or "No space left" in str(err) or (free is not None and free < LOW_SPACE_BYTES)


def _free_bytes(directory: Path) -> int | None:
    """Bytes free to this user on ``directory``'s filesystem (None: not measurable)."""
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


def _checksums_of_shards(tmp_dir: Path, final_dir: Path) -> dict[str, dict[str, Any]]:
    """Collective: the checksums of the files DCP wrote, each rank hashing a share of about equal bytes."""
    listing: list[dict[str, int] | None] = [present_files(tmp_dir) if rank() == 0 else None]
    if distributed():
        dist.broadcast_object_list(listing, src=0)
    assert listing[0] is not None
    mine = shares(listing[0], world_size())[rank()]
    try:
        local, problem = {name: checksum(tmp_dir / name) for name in mine}, None
    except OSError as err:
        local, problem = {}, f"saving checkpoint {final_dir} failed on rank {rank()}: {err}"
    everyone = gather((local, problem))
    problems = [problem for _, problem in everyone if problem]
    if problems:
        raise CheckpointError(problems[0])
    return {name: entry for digests, _ in everyone for name, entry in digests.items()}


def _agree_on_tmp_name(layout_dir: Path, iteration: int, owner: str = "") -> str:
    """Rank 0 removes the stale temporaries of this owner's earlier crashed saves (another run's, maybe in
    progress, stay), creates a fresh one and tells all; or refuses (every rank) to replace another run's
    ``global_step<iteration>``."""
    names: list[str | None] = [None, None]  # the name, or why rank 0 could not make it
    if rank() == 0:
        names[1] = another_runs_checkpoint(layout_dir / f"global_step{iteration}", owner)
    if rank() == 0 and names[1] is None:
        try:
            layout_dir.mkdir(parents=True, exist_ok=True)
            for stale in layout_dir.glob(f"{TMP_PREFIX}*"):
                if is_own_tmp(stale.name, owner):
                    _remove(stale)
            names[0] = tmp_name(f"global_step{iteration}", owner)
            (layout_dir / names[0]).mkdir()
        except OSError as err:
            names[1] = f"saving a checkpoint into {layout_dir} failed on rank 0: {err}"
    if distributed():
        dist.broadcast_object_list(names, src=0)
    if names[1] is not None:
        raise CheckpointError(names[1])
    assert names[0] is not None
    return names[0]


def _write_json_files(directory: Path, documents: dict[str, Any]) -> None:
    for name, document in documents.items():  # fsynced: the directory's rename publishes them
        write_json_atomic(directory / name, document, sort_keys=True)


def _publish(tmp_dir: Path, final_dir: Path) -> None:
    """Rename the finished temporary into place. A re-save of the same iteration swaps the two directories
    atomically where the OS can (Linux), so ``latest`` never names a missing directory; elsewhere the old
    copy moves aside first (complete under ``.tmp-replaced-``) and only the two renames lie between."""
    if not final_dir.exists():
        os.replace(tmp_dir, final_dir)
        fsync_dir(final_dir.parent)
        return
    if exchange_paths(tmp_dir, final_dir):  # durable (fsynced) before the old copy goes
        _remove(tmp_dir)  # now the old copy
        return
    owner = tmp_dir.name.rpartition(OWNER_TAG)[2] if OWNER_TAG in tmp_dir.name else ""  # the save's
    aside = final_dir.with_name(tmp_name(f"replaced-{final_dir.name}", owner))
    os.replace(final_dir, aside)
    os.replace(tmp_dir, final_dir)
    fsync_dir(final_dir.parent)
    _remove(aside)


def _write_marker(marker: Path, target_name: str, owner: str = "") -> None:
    """Atomically replace a marker file with the directory name it points at (a ``.tmp-*`` temporary)."""
    write_atomic(marker, target_name + "\n", tmp=marker.with_name(tmp_name(marker.name, owner)))


def _gather_tied_groups(model_parts: list[nn.Module]) -> list[list[str]]:
    """Names that share one parameter (tied embeddings), from every rank, so export writes it once."""
    groups: dict[int, list[str]] = {}
    for part in model_parts:
        for name, param in part.named_parameters(remove_duplicate=False):
            groups.setdefault(id(param), []).append(name)
    # Each group in model order, so the owner (the token embedding, defined first) comes first.
    local = sorted(list(dict.fromkeys(names)) for names in groups.values() if len(set(names)) > 1)
    if not distributed():
        return local
    return sorted({tuple(group) for groups_of_rank in gather(local) for group in groups_of_rank or []})


def remove_checkpoint(path: Path, owner: str = "") -> None:
    """Remove a checkpoint directory: first renamed to an own temporary (never loaded, and removed by the
    owner's next save if a kill stops the removal), so no reader sees half a checkpoint."""
    aside = path.with_name(tmp_name(f"removed-{path.name}", owner))
    os.replace(path, aside)
    _remove(aside)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
