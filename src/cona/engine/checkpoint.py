"""Reshardable checkpoints: torch.distributed.checkpoint (DCP) shards plus small JSON files.

A checkpoint directory ``<layout>/global_step<N>/`` holds the DCP shards and ``.metadata`` of ``{"model":
model state, "optim": flattened per-parameter AdamW state}``, and ``trainer_state.json``, ``config.json``,
``strategy.json``, ``manifest.json`` and (when the saver measured one) ``probe.json``, the loss of a fixed
probe batch that the next load compares against (:mod:`cona.engine.switch_check`). DCP stores every tensor
with its global shape and the offsets of each shard, so any layout (dp, tp, pp, zero, 1 process) can load what
any other saved. ``manifest.json`` lists every other file with its SHA-256 (:mod:`.checkpoint_manifest`);
every load, export and inspection verifies them first, and nothing in a checkpoint is unpickled beyond plain
data (:mod:`.checkpoint_dcp`).

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
import hashlib
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import set_state_dict

from cona.atomic_files import fsync_dir, write_atomic, write_json_atomic
from cona.config import ConaConfig, ModelConfig
from cona.engine.checkpoint_dcp import METADATA_FILE, dcp_load, dcp_save
from cona.engine.checkpoint_files import (
    CONFIG_FILE,
    TRAINER_STATE_FILE,
    exchange_paths,
    read_dcp_metadata,
    verify_complete,
)
from cona.engine.checkpoint_info import (
    LATEST,
    LATEST_UNIVERSAL,
    PROBE_FILE,
    STEP_DIR,
    STRATEGY_FILE,
    CheckpointInfo,
    read_checkpoint_info,
    resolve_checkpoint,
)
from cona.engine.checkpoint_manifest import (
    FORMAT_VERSION,
    MANIFEST_FILE,
    checksum,
    first_mismatch,
    present_files,
    read_manifest,
    shares,
    unlisted_or_missing,
    write_manifest,
)
from cona.engine.checkpoint_state import (
    STATE_DICT_OPTIONS,
    barrier,
    distributed,
    gather,
    model_and_optimizer_state,
    rank,
    state_root,
    world_size,
)
from cona.engine.optim import initialise_state
from cona.errors import CheckpointError
from cona.strategy import Strategy

__all__ = [
    "CONFIG_FILE",
    "FORMAT_VERSION",
    "LATEST",
    "LATEST_UNIVERSAL",
    "MANIFEST_FILE",
    "METADATA_FILE",
    "PROBE_FILE",
    "STEP_DIR",
    "STRATEGY_FILE",
    "TRAINER_STATE_FILE",
    "CheckpointInfo",
    "layout_dir",
    "load_checkpoint",
    "load_model_tensors",
    "model_and_optimizer_state",
    "model_shape",
    "read_checkpoint_info",
    "resolve_checkpoint",
    "save_checkpoint",
    "verify_checkpoint",
    "verify_complete",
]

TMP_PREFIX = ".tmp-"
OWNER_TAG = "-of-"
OWNER_CHARS = 12
# Parameter-group keys taken from the checkpoint on load; every other key (betas, eps, weight_decay from
# the current config, and the implementation flags fused/foreach, which depend on the current device and
# layout) stays as the current optimizer was built. The lr is set by the schedule every step anyway.
KEYS_FROM_CHECKPOINT = ("params", "lr")
# Model keys that decide which tensors a checkpoint holds and their shapes (ffn_hidden as resolved).
MODEL_SHAPE_KEYS = (
    "layers",
    "hidden",
    "heads",
    "seq",
    "ffn_hidden",
    "vocab_size",
    "padded_vocab_size",
    "normalization",
    "family",
    "kv_heads",
    "activation",
    "position_embedding",
    "tie_embeddings",
    "bias",
)


def layout_dir(workdir: Path, config: ConaConfig, strategy: Strategy, dtype: str) -> Path:
    """``<workdir>/checkpoints/<model.name>/z<zero_stage>/<dtype>/tp<tp>_pp<pp>_dp<dp>_sp1``."""
    return Path(workdir, "checkpoints", config.model.name, f"z{strategy.zero_stage}", dtype, strategy.layout)


def model_shape(model: ModelConfig) -> dict[str, Any]:
    """The model keys that decide the set and shapes of the saved tensors (ffn_hidden resolved)."""
    return {key: getattr(model, "ffn_size" if key == "ffn_hidden" else key) for key in MODEL_SHAPE_KEYS}


# ----------------------------------------------------------------------------------------------- save


def save_checkpoint(
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
) -> Path:
    """Collective: save model and optimizer state as ``<layout_dir>/global_step<iteration>`` with its
    checksum manifest and point ``latest`` at it, with ``probe`` (a
    :class:`cona.engine.switch_check.ProbeRecord` as a dict) beside it when given. Also works without a
    process group (one process). A failure on any rank is one :class:`CheckpointError` line with its cause.
    ``owner`` tags the save's temporaries (:func:`tmp_owner` of the run directory): a save removes only
    stale temporaries of its own owner, never another run's save in progress."""
    layout_dir = Path(layout_dir)
    final_dir = layout_dir / f"global_step{iteration}"
    with _save_failures(final_dir):
        tmp_dir = layout_dir / _agree_on_tmp_name(layout_dir, iteration, owner)
        model_state, optim_state = model_and_optimizer_state(model_parts, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp_save(state, tmp_dir, distributed=distributed(), what=f"saving checkpoint {final_dir}")
        tied = _gather_tied_groups(model_parts)
        barrier()
        files = _checksums_of_shards(tmp_dir, final_dir)
        if rank() == 0:
            documents = {
                TRAINER_STATE_FILE: trainer_state,
                CONFIG_FILE: config.to_dict(),
                STRATEGY_FILE: dataclasses.asdict(strategy),
            }
            _write_json_files(tmp_dir, documents | ({PROBE_FILE: probe} if probe is not None else {}))
            fields = {
                "iteration": iteration,
                "model_shape": model_shape(config.model),
                "tied_parameters": tied,
                "model_tensors": sorted(model_state),
                "optimizer_tensors": sorted(optim_state),
            }
            files |= {name: checksum(tmp_dir / name) for name in present_files(tmp_dir) if name not in files}
            write_manifest(tmp_dir, fields, files)  # before the rename: a published checkpoint has one
            _publish(tmp_dir, final_dir)
            _write_marker(layout_dir / LATEST, final_dir.name, owner)
    barrier()
    return final_dir


@contextlib.contextmanager
def _save_failures(final_dir: Path) -> Iterator[None]:
    """An OS error while saving (no space left, no permission) as one line with its cause and the path."""
    try:
        yield
    except OSError as err:
        raise CheckpointError(f"saving checkpoint {final_dir} failed on rank {rank()}: {err}") from None


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


def tmp_owner(run_dir: Path) -> str:
    """The owner tag of a run's checkpoint temporaries: a digest of its resolved run directory."""
    return hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:OWNER_CHARS]


def _tmp_name(kind: str, owner: str) -> str:
    """``.tmp-<kind>-<random>``, with ``-of-<owner>`` when the save has an owner."""
    return f"{TMP_PREFIX}{kind}-{secrets.token_hex(4)}" + (f"{OWNER_TAG}{owner}" if owner else "")


def _is_own_tmp(name: str, owner: str) -> bool:
    if not name.startswith(TMP_PREFIX):
        return False
    return name.endswith(f"{OWNER_TAG}{owner}") if owner else OWNER_TAG not in name


def _agree_on_tmp_name(layout_dir: Path, iteration: int, owner: str = "") -> str:
    """Rank 0 removes the stale temporaries of this owner's earlier crashed saves (another run's, maybe in
    progress, stay), creates a fresh one and tells all."""
    names: list[str | None] = [None, None]  # the name, or why rank 0 could not make it
    if rank() == 0:
        try:
            layout_dir.mkdir(parents=True, exist_ok=True)
            for stale in layout_dir.glob(f"{TMP_PREFIX}*"):
                if _is_own_tmp(stale.name, owner):
                    _remove(stale)
            names[0] = _tmp_name(f"global_step{iteration}", owner)
            (layout_dir / names[0]).mkdir()
        except OSError as err:
            names[1] = str(err)
    if distributed():
        dist.broadcast_object_list(names, src=0)
    if names[1] is not None:
        raise CheckpointError(f"saving a checkpoint into {layout_dir} failed on rank 0: {names[1]}")
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
    aside = final_dir.with_name(_tmp_name(f"replaced-{final_dir.name}", owner))
    os.replace(final_dir, aside)
    os.replace(tmp_dir, final_dir)
    fsync_dir(final_dir.parent)
    _remove(aside)


def _write_marker(marker: Path, target_name: str, owner: str = "") -> None:
    """Atomically replace a marker file with the directory name it points at (a ``.tmp-*`` temporary)."""
    write_atomic(marker, target_name + "\n", tmp=marker.with_name(_tmp_name(marker.name, owner)))


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


# ----------------------------------------------------------------------------------------------- load


def load_checkpoint(
    path: Path, *, model_parts: list[nn.Module], optimizer: torch.optim.Optimizer, config: ConaConfig
) -> dict:
    """Collective: load a checkpoint saved under any layout into this one; returns its trainer_state.
    Its files are verified against its manifest first (each rank hashing a share)."""
    checkpoint = resolve_checkpoint(path)
    verify_checkpoint(checkpoint, collective=distributed())
    _check_compatible(checkpoint, config.model)
    # Tensors of the current layout, which DCP fills in (AdamW's state is created first if missing).
    initialise_state(optimizer)
    model_state, optim_state = model_and_optimizer_state(model_parts, optimizer)
    state = {"model": model_state, "optim": optim_state}
    _check_tensors_present(checkpoint, state)
    kept = [
        {k: v for k, v in group.items() if k not in KEYS_FROM_CHECKPOINT} for group in optimizer.param_groups
    ]
    dcp_load(state, checkpoint, distributed=distributed())
    set_state_dict(
        state_root(model_parts),
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=STATE_DICT_OPTIONS,
    )
    for group, values in zip(optimizer.param_groups, kept, strict=True):
        group.update(values)
    return read_checkpoint_info(checkpoint).trainer_state


def verify_checkpoint(path: Path, *, collective: bool = False) -> dict[str, Any]:
    """Refuse (one :class:`CheckpointError` line naming the file) a checkpoint whose files are not the ones
    its manifest lists with their SHA-256, or that is incomplete (:func:`verify_complete`); returns the
    manifest. ``collective``: every rank calls it and hashes a share of the files."""
    checkpoint = resolve_checkpoint(path)
    manifest = read_manifest(checkpoint)
    problem = unlisted_or_missing(checkpoint, manifest)
    if problem is not None:
        raise CheckpointError(problem)
    sizes = {name: entry["size"] for name, entry in manifest["files"].items()}
    parts, me = (world_size(), rank()) if collective else (1, 0)
    found = first_mismatch(checkpoint, manifest, shares(sizes, parts)[me])
    problems = [p for p in (gather(found) if collective else [found]) if p is not None]
    if problems:
        raise CheckpointError(problems[0])
    verify_complete(checkpoint)
    return manifest


def _check_compatible(path: Path, model: ModelConfig) -> None:
    """The same model shape as the current config."""
    theirs, ours = model_shape(read_checkpoint_info(path).config.model), model_shape(model)
    for key, value in ours.items():
        if theirs[key] != value:
            why = f"model.{key} is {theirs[key]} there and {value} in the current config"
            raise CheckpointError(f"{path}: checkpoint of another model shape: {why}")


def _check_tensors_present(path: Path, state: dict[str, dict[str, Any]]) -> None:
    """Every tensor the current layout needs is in the checkpoint with the same global shape."""
    saved = read_dcp_metadata(path).state_dict_metadata
    for section, entries in state.items():
        for name, value in entries.items():
            if not isinstance(value, torch.Tensor):
                continue
            entry = saved.get(f"{section}.{name}")
            if entry is None:
                raise CheckpointError(f"{path}: the checkpoint has no {section} tensor {name}")
            if isinstance(entry, TensorStorageMetadata) and tuple(entry.size) != tuple(value.shape):
                shapes = f"{tuple(entry.size)} there and {tuple(value.shape)} here"
                raise CheckpointError(f"{path}: {section} tensor {name} has shape {shapes}")


# ------------------------------------------------------------------------- reading without a process group


def load_model_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The full (consolidated) model tensors of a checkpoint, read in this process alone."""
    checkpoint = resolve_checkpoint(path)
    verify_checkpoint(checkpoint)
    metadata = read_dcp_metadata(checkpoint)
    model: dict[str, torch.Tensor] = {}
    for key, entry in metadata.state_dict_metadata.items():
        section, *name_parts = metadata.planner_data[key]
        if section == "model" and isinstance(entry, TensorStorageMetadata):
            model[".".join(map(str, name_parts))] = torch.empty(entry.size, dtype=entry.properties.dtype)
    dcp_load({"model": model}, checkpoint, distributed=False)
    return model


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
