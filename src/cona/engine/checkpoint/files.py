"""Is a checkpoint directory complete? Checks of its files alone, without loading a tensor or a process group.

A PyTorch distributed checkpoint is complete when its DCP metadata reads, every tensor's shards are stored and
cover it, every shard file is there at least as long as the metadata says, and CONA's JSON files are there.

The runner imports this module at its start, where torch is not otherwise needed (importing
``torch.distributed.checkpoint`` takes seconds, up to 3-4 s on a GPU host): DCP is imported when a
checkpoint's metadata is read, or before, in a thread of its own, while the first stage of a run that may
publish trains (:func:`cona.runner.publish.import_checkpoint_reader_in_background`).
"""

from __future__ import annotations

import ctypes
import errno
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

from cona.atomic_files import fsync_dir
from cona.errors import CheckpointError

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

TRAINER_STATE_FILE = "trainer_state.json"
CONFIG_FILE = "config.json"
METADATA_FILE = ".metadata"
"""DCP's metadata file in a checkpoint directory."""


def verify_complete(path: Path) -> None:
    """Refuse (CheckpointError naming the path) a checkpoint that cannot be loaded in full: unreadable
    or missing DCP metadata, a tensor whose shards do not cover it, a shard file missing or shorter than
    the metadata says, or a missing trainer_state.json / config.json."""
    path = Path(path)
    metadata = read_dcp_metadata(path)
    for name in (TRAINER_STATE_FILE, CONFIG_FILE):
        if not (path / name).is_file():
            raise CheckpointError(f"{path}: incomplete checkpoint: {name} is missing")
    _check_chunks_cover_tensors(path, metadata)
    _check_shard_files(path, metadata)


def read_dcp_metadata(path: Path) -> Metadata:
    """The DCP metadata, through the reader that refuses any global but DCP's metadata classes."""
    from cona.engine.checkpoint.dcp import SafeFileSystemReader  # DCP (and torch) only here: see above

    if not (path / METADATA_FILE).is_file():
        raise CheckpointError(f"{path}: incomplete checkpoint: no DCP {METADATA_FILE} file")
    return SafeFileSystemReader(path).read_metadata()


def _check_chunks_cover_tensors(path: Path, metadata: Metadata) -> None:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    stored = {(index.fqn, tuple(index.offset or ())) for index in metadata.storage_data}
    for fqn, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            continue
        covered = 0
        for chunk in entry.chunks:
            if (fqn, tuple(chunk.offsets)) not in stored:
                raise CheckpointError(f"{path}: incomplete checkpoint: a shard of {fqn} is not stored")
            covered += math.prod(chunk.sizes)
        if covered != math.prod(entry.size):
            raise CheckpointError(f"{path}: incomplete checkpoint: the shards of {fqn} do not cover it")


def _check_shard_files(path: Path, metadata: Metadata) -> None:
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for relative, size in sorted(needed.items()):
        shard = path / relative
        if not shard.is_file():
            raise CheckpointError(f"{path}: incomplete checkpoint: shard file {relative} is missing")
        actual = shard.stat().st_size
        if actual < size:
            raise CheckpointError(f"{path}: shard file {relative} is truncated ({actual} of {size} bytes)")


def exchange_paths(first: Path, second: Path) -> bool:
    """Swap two paths of one directory atomically (renameat2 with RENAME_EXCHANGE), and fsync the directory;
    False where the OS or filesystem has no such call, an OSError for any other failure."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(first), at_fdcwd, os.fsencode(second), rename_exchange) == 0:
        fsync_dir(Path(second).parent)
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EPERM):
        return False
    raise OSError(code, os.strerror(code), str(second))
