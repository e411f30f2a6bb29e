"""Loading a checkpoint under any layout, verifying its files first, and reading its model tensors alone.

See :mod:`cona.engine.checkpoint` for what a checkpoint directory holds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import set_state_dict

from cona.config import ConaConfig, ModelConfig
from cona.engine.checkpoint.dcp import dcp_load
from cona.engine.checkpoint.files import read_dcp_metadata, verify_complete
from cona.engine.checkpoint.info import model_shape, read_checkpoint_info, resolve_checkpoint
from cona.engine.checkpoint.manifest import first_mismatch, read_manifest, shares, unlisted_or_missing
from cona.engine.checkpoint.state import (
    STATE_DICT_OPTIONS,
    distributed,
    gather,
    model_and_optimizer_state,
    rank,
    state_root,
    world_size,
)
from cona.engine.optim import initialise_state
from cona.errors import CheckpointError

# Parameter-group keys taken from the checkpoint on load; every other key (betas, eps, weight_decay from
# the current config, and the implementation flags fused/foreach, which depend on the current device and
# layout) stays as the current optimizer was built. The lr is set by the schedule every step anyway.
KEYS_FROM_CHECKPOINT = ("params", "lr")


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
