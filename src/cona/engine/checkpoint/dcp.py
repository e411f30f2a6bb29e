"""DCP reads and writes as CONA does them: nothing a checkpoint holds can run code, and a failure is one line.

A DCP checkpoint holds two kinds of pickles. ``.metadata`` is a plain pickle of DCP's ``Metadata``: it is read
by :class:`SafeFileSystemReader`, whose unpickler resolves only DCP's own metadata classes, torch dtypes,
sizes and layouts and paths (an allow-list: Python's documented way of restricting globals), so a crafted
file is refused before any object is built. Every storage path the metadata records must name a file inside
the checkpoint that its ``manifest.json`` lists: an absolute path or one with ``..`` (which would read another
checkpoint's tensors, or any file) is refused. Non-tensor entries (the optimizer's param_groups) are
``torch.save`` blobs inside the shard files: :class:`WeightsOnlyLoadPlanner` loads them with
``torch.load(weights_only=True)`` instead of DCP's default ``weights_only=False``. Tensors DCP already
loads weights-only.

DCP reports a failure on any rank as ``CheckpointException ranks:dict_keys([...])`` with the causes in a
traceback per rank; :func:`dcp_save` and :func:`dcp_load` turn it into one :class:`CheckpointError` line with
the first rank's cause and the checkpoint's path.
"""

from __future__ import annotations

import contextlib
import io
import json
import pickle
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path, PurePosixPath
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from cona.engine.checkpoint.manifest import MANIFEST_FILE
from cona.errors import CheckpointError

_METADATA_GLOBALS = {
    **{(dcp_metadata.__name__, name): getattr(dcp_metadata, name) for name in dcp_metadata.__all__},
    (dcp_metadata.__name__, "_MEM_FORMAT_ENCODING"): dcp_metadata._MEM_FORMAT_ENCODING,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): dcp.filesystem._StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("pathlib", "PosixPath"): Path,
    ("pathlib", "PurePosixPath"): Path,
    ("collections", "OrderedDict"): dict,
}
"""Every global a DCP ``.metadata`` pickle names (and torch dtypes, :meth:`MetadataUnpickler.find_class`).
The layout function only looks a layout up by name; the path is what DCP records as the checkpoint id."""


class ForbiddenGlobal(pickle.UnpicklingError):
    """A pickle names a global outside the allow-list (nothing was built from it)."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata and refuses any other global (a function to call, a class to build)."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = _METADATA_GLOBALS.get((module, name))
        if allowed is not None:
            return allowed
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise ForbiddenGlobal(f"it names {module}.{name}, which is not DCP metadata")


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file-system reader with :class:`MetadataUnpickler` for the (global or rank-local) metadata."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        with path.open("rb") as handle:
            try:
                metadata = MetadataUnpickler(handle).load()
            except ForbiddenGlobal as err:
                raise CheckpointError(f"{path}: refused, {err}; nothing in it was run") from None
            except Exception as err:  # a truncated or garbled pickle can raise almost anything
                raise CheckpointError(f"{path}: unreadable ({type(err).__name__})") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path}: not DCP metadata (a {type(metadata).__name__})")
        _check_storage_paths(path, metadata)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _check_storage_paths(metadata_path: Path, metadata: Metadata) -> None:
    """Refuse a storage path outside the checkpoint: absolute, with ``..``, or not among the files its
    manifest lists (when it has one: a save in progress has none yet)."""
    listed = _manifest_files(metadata_path.parent)
    for index, stored in (metadata.storage_data or {}).items():
        relative = getattr(stored, "relative_path", None)
        parts = PurePosixPath(relative).parts if isinstance(relative, str) else ()
        outside = not parts or PurePosixPath(relative).is_absolute() or ".." in parts
        if outside or (listed is not None and relative not in listed):
            where = "outside the checkpoint" if outside else "a file its manifest does not list"
            raise CheckpointError(
                f"{metadata_path}: tensor {getattr(index, 'fqn', index)} is stored at {relative!r}, {where}; "
                "refusing the checkpoint"
            )


def _manifest_files(checkpoint: Path) -> set[str] | None:
    """The file names the checkpoint's manifest lists (None: no readable manifest; its own checks refuse
    that before a load)."""
    try:
        files = json.loads((checkpoint / MANIFEST_FILE).read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        return None
    return set(files) if isinstance(files, dict) else None


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that non-tensor entries load weights-only (plain data)."""

    def __init__(self, checkpoint: Path) -> None:
        super().__init__()
        self.checkpoint = Path(checkpoint)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            stored = self.metadata.storage_data[read_item.storage_index] if self.metadata else None
            file = self.checkpoint / stored.relative_path if stored is not None else self.checkpoint
            raise CheckpointError(
                f"{file}: entry {read_item.storage_index.fqn} is not plain data ({_unsupported(err)}); "
                "refused, nothing in it was run"
            ) from None
        # What DefaultLoadPlanner.load_bytes does with the value it loaded.
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def _unsupported(err: pickle.UnpicklingError) -> str:
    """The line of torch's weights-only refusal that names what was refused."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    named = [line for line in lines if line.startswith("Unsupported") or "GLOBAL" in line]
    return (named or lines or ["weights-only load failed"])[0]


def dcp_save(state: dict[str, Any], directory: Path, *, distributed: bool, what: str) -> None:
    """``dcp.save`` into ``directory``; any rank's failure is one line, ``<what> failed on rank R: ...``."""
    try:
        with _quiet_single_process():
            dcp.save(state, checkpoint_id=directory, no_dist=not distributed)
    except CheckpointException as err:
        raise failure_line(err, f"{what} failed") from None


def dcp_async_save(
    state: dict[str, Any], directory: Path, *, group: dist.ProcessGroup | None, distributed: bool
) -> Future:
    """``dcp.async_save`` into ``directory``: the state is copied to host memory before this returns and
    written by a thread (agreeing over ``group``); its future raises what DCP raised
    (see :func:`failure_line`)."""
    with _quiet_single_process():
        return dcp.async_save(state, checkpoint_id=directory, process_group=group, no_dist=not distributed)


def dcp_load(state: dict[str, Any], checkpoint: Path, *, distributed: bool) -> None:
    """``dcp.load`` of ``checkpoint`` into ``state`` through the safe reader and planner."""
    try:
        with _quiet_single_process():
            dcp.load(
                state,
                storage_reader=SafeFileSystemReader(checkpoint),
                planner=WeightsOnlyLoadPlanner(checkpoint),
                no_dist=not distributed,
            )
    except CheckpointException as err:
        raise failure_line(err, f"loading checkpoint {checkpoint} failed") from None


def failure_line(err: CheckpointException, what: str) -> CheckpointError:
    """One line from DCP's per-rank failures: a CONA refusal as it is, else ``what`` with the first cause."""
    failures = sorted(err.failures.items())
    if not failures:
        return CheckpointError(f"{what}: {str(err).splitlines()[0]}")
    for _, (cause, _) in failures:
        if isinstance(cause, CheckpointError):
            return cause
    rank, (cause, _) = failures[0]
    others = f" (also on rank{'s' if len(failures) > 2 else ''} {', '.join(str(r) for r, _ in failures[1:])})"
    text = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
    return CheckpointError(
        f"{what} on rank {rank}: {type(cause).__name__}: {text}{others if len(failures) > 1 else ''}"
    )


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """Silence DCP's warning that it assumes one process: without a process group that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=".*assuming the intent is to (save|load) in a single process"
        )
        yield
