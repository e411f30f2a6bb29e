"""Publish a stage's checkpoint as universal, and prune universal copies.

A DCP checkpoint is already topology-free: any (dp, tp, pp) can load it and reshard on the fly, so
"converting" it needs no tensor work. Publishing verifies that it is complete (metadata readable, every
tensor's chunks covered by a storage record whose file is there and long enough) and exposes it as
``global_step<N>_universal`` beside the original, then points ``latest_universal`` at it.

The universal directory holds **hard links** to the original files, not copies and not a manifest: no byte
is duplicated, nothing but the directory entries is written, and deleting either directory leaves the
other intact (a file's data lives until its last link goes), so pruning universal copies never damages the
layout's own ``global_step<N>`` and vice versa. Only where hard links are impossible (another filesystem,
or one without links) is a file copied, with a warning.

Crash safety: the universal directory is assembled under ``<name>.tmp`` and renamed into place, and the
marker is written last through a temporary file; a directory being pruned is first renamed to
``<name>.deleting``. So a reader never sees a half-made or half-deleted universal directory, and rerunning
``publish`` or ``prune`` after a kill at any point finishes the job.
"""

from __future__ import annotations

import errno
import filecmp
import logging
import os
import re
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

from cona.atomic_files import write_atomic
from cona.engine.checkpoint.files import verify_complete
from cona.engine.checkpoint.info import LATEST_UNIVERSAL
from cona.errors import CheckpointError
from cona.runner.chain_file import PruneRule

LOG = logging.getLogger(__name__)
UNIVERSAL_SUFFIX = "_universal"
_GLOBAL_STEP = re.compile(r"global_step(\d+)")
_LINK_UNSUPPORTED = (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP)


@dataclass(frozen=True, kw_only=True, slots=True)
class PruneResult:
    """What one pruning entry removed."""

    layout_dir: Path
    removed: tuple[str, ...]
    kept: str | None
    """The universal directory kept (keep-latest), if any."""


def universal_name(global_step_dir: Path) -> str:
    match = _GLOBAL_STEP.fullmatch(global_step_dir.name)
    if match is None:
        raise CheckpointError(f"{global_step_dir}: not a global_step<N> checkpoint directory")
    return f"global_step{int(match.group(1))}{UNIVERSAL_SUFFIX}"


def publish(global_step_dir: Path) -> Path:
    """Verify ``global_step_dir`` and expose it as ``global_step<N>_universal`` with the ``latest_universal``
    marker beside it. Idempotent: rerunning after a kill completes what was left."""
    source = Path(global_step_dir)
    final = source.parent / universal_name(source)
    if final.is_dir() and not _links_to(final, source):
        _remove_dir(final)  # an earlier run's copy of the same iteration, not this checkpoint
    if not final.is_dir():
        verify_complete(source)
        tmp = final.with_name(final.name + ".tmp")
        if tmp.exists():
            shutil.rmtree(tmp)  # left by a publish that was killed halfway
        _link_tree(source, tmp)
        os.replace(tmp, final)
    write_marker(source.parent / LATEST_UNIVERSAL, final.name)
    return final


def import_checkpoint_reader_in_background() -> threading.Thread:
    """Import what :func:`publish` verifies a checkpoint with (DCP, and torch with it) in a thread of its own,
    so that the run's first publish does not wait for it: the runner starts without torch, and this import
    takes seconds (1.6-1.9 s on a 2-core CPU, more on some GPU hosts). Started while the first stage's workers
    start and train; not a daemon, so the runner never exits in the middle of an import."""

    def load() -> None:
        import cona.engine.checkpoint.dcp  # noqa: F401 (what read_dcp_metadata imports)

    thread = threading.Thread(target=load, name="import-checkpoint-reader")
    thread.start()
    return thread


def _links_to(universal: Path, source: Path) -> bool:
    """Whether ``universal`` holds exactly ``source``'s files (the same inodes, or equal copies)."""
    source_files = sorted(p.relative_to(source) for p in source.rglob("*") if p.is_file())
    universal_files = sorted(p.relative_to(universal) for p in universal.rglob("*") if p.is_file())
    if source_files != universal_files:
        return False
    return all(
        os.path.samefile(source / name, universal / name)
        or filecmp.cmp(source / name, universal / name, shallow=False)
        for name in source_files
    )


def _link_tree(source: Path, target: Path) -> None:
    """Recreate ``source``'s tree at ``target`` with hard links (copies only where links are impossible)."""
    for directory, _, files in os.walk(source):
        relative = Path(directory).relative_to(source)
        (target / relative).mkdir(parents=True, exist_ok=True)
        for name in files:
            _link_or_copy(Path(directory, name), target / relative / name)


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError as err:
        if err.errno not in _LINK_UNSUPPORTED:
            raise
        LOG.warning(
            "cannot hard-link %s (%s); copying it instead, which duplicates its bytes", source, err.strerror
        )
        shutil.copy2(source, target)


def write_marker(marker: Path, name: str) -> None:
    """Write a marker file naming a directory, atomically (the fsync of the directory also makes the
    rename of the directory it names durable)."""
    write_atomic(marker, name)


def read_marker(marker: Path) -> str | None:
    try:
        return marker.read_text().strip() or None
    except FileNotFoundError:
        return None


def prune(rule: PruneRule, layout_dir: Path) -> PruneResult:
    """Apply one pruning entry to ``layout_dir``, the run's own folder of the layout the entry names.
    Idempotent: safe to rerun after a kill mid-prune.

    keep-latest removes every ``*_universal`` directory except the one ``latest_universal`` names; when no
    marker exists it removes nothing (it cannot tell which copy is live). delete-all removes the marker
    first (so it never names a half-deleted directory), then every ``*_universal`` directory.
    """
    layout_dir = Path(layout_dir)
    if not layout_dir.is_dir():
        return PruneResult(layout_dir=layout_dir, removed=(), kept=None)
    marker = layout_dir / LATEST_UNIVERSAL
    kept = read_marker(marker) if rule.mode == "keep-latest" else None
    if rule.mode == "keep-latest" and kept is None:
        LOG.warning("%s has no %s marker; keep-latest removes nothing", layout_dir, LATEST_UNIVERSAL)
        return PruneResult(layout_dir=layout_dir, removed=(), kept=None)
    if rule.mode == "delete-all":
        marker.unlink(missing_ok=True)
    removed = []
    for entry in sorted(layout_dir.iterdir()):
        if not entry.is_dir():
            continue
        if _is_leftover(entry.name) or (entry.name.endswith(UNIVERSAL_SUFFIX) and entry.name != kept):
            _remove_dir(entry)
            removed.append(entry.name.removesuffix(".deleting"))
    return PruneResult(layout_dir=layout_dir, removed=tuple(removed), kept=kept)


def _is_leftover(name: str) -> bool:
    """A universal directory a killed publish or prune left behind."""
    return name.endswith((f"{UNIVERSAL_SUFFIX}.tmp", f"{UNIVERSAL_SUFFIX}.deleting"))


def _remove_dir(path: Path) -> None:
    doomed = path if path.name.endswith(".deleting") else path.with_name(path.name + ".deleting")
    if doomed != path:
        if doomed.exists():
            shutil.rmtree(doomed)  # an earlier prune of a same-named directory was killed halfway
        os.replace(path, doomed)
    shutil.rmtree(doomed)
