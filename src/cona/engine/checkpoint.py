"""Reshardable checkpoints: torch.distributed.checkpoint (DCP) shards plus small JSON files.

A checkpoint directory ``<layout>/global_step<N>/`` holds the DCP shards and ``.metadata`` of ``{"model":
model state, "optim": flattened per-parameter AdamW state}``, and ``trainer_state.json``, ``config.json``,
``strategy.json``, ``manifest.json`` and (when the saver measured one) ``probe.json``, the loss of a fixed
probe batch that the next load compares against (:mod:`cona.engine.switch_check`). DCP stores every tensor
with its global shape and the offsets of each shard, so any layout (dp, tp, pp, zero, 1 process) can load what
any other saved. Crash safety comes from the order of writes: shards and JSON go to
``.tmp-global_step<N>-<id>``, which rank 0 renames to ``global_step<N>`` once every rank finished; only then
is the ``latest`` marker replaced (itself through a temporary file and a rename). A kill at any point leaves
``latest`` naming either the previous checkpoint or the complete new one; leftover ``.tmp-*`` entries are
never loaded and are removed by the next save.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import secrets
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from cona.config import ConaConfig, ModelConfig, parse_config
from cona.engine.checkpoint_files import (
    CONFIG_FILE,
    METADATA_FILE,
    TRAINER_STATE_FILE,
    read_dcp_metadata,
    verify_complete,
)
from cona.engine.optim import initialise_state
from cona.errors import CheckpointError, ConaError
from cona.strategy import Strategy

FORMAT_VERSION = 1
LATEST = "latest"
LATEST_UNIVERSAL = "latest_universal"
TMP_PREFIX = ".tmp-"
STRATEGY_FILE = "strategy.json"
MANIFEST_FILE = "manifest.json"
PROBE_FILE = "probe.json"
STEP_DIR = re.compile(r"global_step(\d+)(_universal)?")
STATE_DICT_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
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
) -> Path:
    """Collective: save model and optimizer state as ``<layout_dir>/global_step<iteration>`` and point
    ``latest`` at it, with ``probe`` (a :class:`cona.engine.switch_check.ProbeRecord` as a dict) beside it
    when given. Also works without a process group (one process)."""
    layout_dir = Path(layout_dir)
    tmp_dir = layout_dir / _agree_on_tmp_name(layout_dir, iteration)
    model_state, optim_state = model_and_optimizer_state(model_parts, optimizer)
    with _quiet_single_process():
        dcp.save(
            {"model": model_state, "optim": optim_state}, checkpoint_id=tmp_dir, no_dist=not _distributed()
        )
    tied = _gather_tied_groups(model_parts)
    _barrier()
    final_dir = layout_dir / f"global_step{iteration}"
    if _rank() == 0:
        manifest = {
            "format_version": FORMAT_VERSION,
            "iteration": iteration,
            "model_shape": model_shape(config.model),
            "tied_parameters": tied,
            "model_tensors": sorted(model_state),
            "optimizer_tensors": sorted(optim_state),
        }
        documents = {
            TRAINER_STATE_FILE: trainer_state,
            CONFIG_FILE: config.to_dict(),
            STRATEGY_FILE: dataclasses.asdict(strategy),
            MANIFEST_FILE: manifest,
        }
        _write_json_files(tmp_dir, documents | ({PROBE_FILE: probe} if probe is not None else {}))
        _publish(tmp_dir, final_dir)
        _write_marker(layout_dir / LATEST, final_dir.name)
    _barrier()
    return final_dir


def _agree_on_tmp_name(layout_dir: Path, iteration: int) -> str:
    """Rank 0 removes stale temporaries of earlier crashed saves, creates a fresh one and tells all."""
    names: list[str | None] = [None]
    if _rank() == 0:
        layout_dir.mkdir(parents=True, exist_ok=True)
        for stale in layout_dir.glob(f"{TMP_PREFIX}*"):
            _remove(stale)
        names[0] = f"{TMP_PREFIX}global_step{iteration}-{secrets.token_hex(4)}"
        (layout_dir / names[0]).mkdir()
    if _distributed():
        dist.broadcast_object_list(names, src=0)
    assert names[0] is not None
    return names[0]


def _write_json_files(directory: Path, documents: dict[str, Any]) -> None:
    for name, document in documents.items():
        (directory / name).write_text(json.dumps(document, indent=1, sort_keys=True) + "\n")


def _publish(tmp_dir: Path, final_dir: Path) -> None:
    """Rename the finished temporary into place. Saving the same iteration again (a stage that ended
    right after loading) moves the old copy aside first; only the two renames lie between."""
    if final_dir.exists():
        aside = final_dir.with_name(f"{TMP_PREFIX}replaced-{final_dir.name}-{secrets.token_hex(4)}")
        os.replace(final_dir, aside)
        os.replace(tmp_dir, final_dir)
        _remove(aside)
    else:
        os.replace(tmp_dir, final_dir)


def _write_marker(marker: Path, target_name: str) -> None:
    """Atomically replace a marker file with the directory name it points at."""
    tmp = marker.with_name(f"{TMP_PREFIX}{marker.name}-{secrets.token_hex(4)}")
    tmp.write_text(target_name + "\n")
    os.replace(tmp, marker)


def _gather_tied_groups(model_parts: list[nn.Module]) -> list[list[str]]:
    """Names that share one parameter (tied embeddings), from every rank, so export writes it once."""
    groups: dict[int, list[str]] = {}
    for part in model_parts:
        for name, param in part.named_parameters(remove_duplicate=False):
            groups.setdefault(id(param), []).append(name)
    # Each group in model order, so the owner (the token embedding, defined first) comes first.
    local = sorted(list(dict.fromkeys(names)) for names in groups.values() if len(set(names)) > 1)
    if not _distributed():
        return local
    everyone: list[list[list[str]] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    return sorted({tuple(group) for groups_of_rank in everyone for group in groups_of_rank or []})


# ----------------------------------------------------------------------------------------------- load


def load_checkpoint(
    path: Path, *, model_parts: list[nn.Module], optimizer: torch.optim.Optimizer, config: ConaConfig
) -> dict:
    """Collective: load a checkpoint saved under any layout into this one; returns its trainer_state."""
    checkpoint = resolve_checkpoint(path)
    verify_complete(checkpoint)
    _check_compatible(checkpoint, config.model)
    # Tensors of the current layout, which DCP fills in (AdamW's state is created first if missing).
    initialise_state(optimizer)
    model_state, optim_state = model_and_optimizer_state(model_parts, optimizer)
    state = {"model": model_state, "optim": optim_state}
    _check_tensors_present(checkpoint, state)
    kept = [
        {k: v for k, v in group.items() if k not in KEYS_FROM_CHECKPOINT} for group in optimizer.param_groups
    ]
    with _quiet_single_process():
        dcp.load(state, checkpoint_id=checkpoint, no_dist=not _distributed())
    set_state_dict(
        _state_root(model_parts),
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=STATE_DICT_OPTIONS,
    )
    for group, values in zip(optimizer.param_groups, kept, strict=True):
        group.update(values)
    return read_checkpoint_info(checkpoint).trainer_state


def resolve_checkpoint(path: Path) -> Path:
    """The checkpoint directory ``path`` names: itself, or what its ``latest``/``latest_universal``
    marker (or the marker file ``path`` itself) points at."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if path.is_file():
        return _follow_marker(path)
    if (path / METADATA_FILE).exists() or STEP_DIR.fullmatch(path.name):
        return path
    for marker in (LATEST, LATEST_UNIVERSAL):
        if (path / marker).is_file():
            return _follow_marker(path / marker)
    raise CheckpointError(
        f"{path}: no checkpoint here: no '{LATEST}' or '{LATEST_UNIVERSAL}' marker and no "
        f"DCP {METADATA_FILE} file"
    )


def _follow_marker(marker: Path) -> Path:
    try:
        name = marker.read_text(encoding="utf-8").strip()
    except UnicodeDecodeError:
        raise CheckpointError(
            f"{marker}: not a checkpoint: expected a checkpoint directory or a marker file naming one"
        ) from None
    if not name or "/" in name or name.startswith("."):
        raise CheckpointError(
            f"{marker}: not a checkpoint marker (expected a global_step<N> directory name, got {name!r})"
        )
    target = marker.parent / name
    if not target.is_dir():
        raise CheckpointError(f"{marker} names {name}, which does not exist in {marker.parent}")
    return target


def _check_compatible(path: Path, model: ModelConfig) -> None:
    """Same format version (when a manifest says) and the same model shape as the current config."""
    info = read_checkpoint_info(path)
    version = (info.manifest or {}).get("format_version", FORMAT_VERSION)
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: checkpoint format version {version}; this CONA reads {FORMAT_VERSION}"
        )
    theirs, ours = model_shape(info.config.model), model_shape(model)
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


@dataclass(frozen=True, kw_only=True)
class CheckpointInfo:
    """The JSON files of a checkpoint directory (no tensors)."""

    path: Path
    trainer_state: dict
    config: ConaConfig
    strategy: Strategy | None
    manifest: dict | None
    probe: dict | None = None
    """The probe loss measured before the save (``probe.json``), if the saver recorded one."""


def read_checkpoint_info(path: Path) -> CheckpointInfo:
    """Read a checkpoint's JSON files; needs no process group (call it on one rank)."""
    checkpoint = resolve_checkpoint(path)
    trainer_state = _read_json(checkpoint, TRAINER_STATE_FILE)
    raw_config = _read_json(checkpoint, CONFIG_FILE)
    try:
        config = parse_config(raw_config, source=checkpoint / CONFIG_FILE)
    except ConaError as err:
        raise CheckpointError(f"{checkpoint}: unusable {CONFIG_FILE}: {err}") from None
    strategy = _read_json(checkpoint, STRATEGY_FILE, optional=True)
    manifest = _read_json(checkpoint, MANIFEST_FILE, optional=True)
    probe = _read_json(checkpoint, PROBE_FILE, optional=True)
    return CheckpointInfo(
        path=checkpoint,
        trainer_state=trainer_state,
        config=config,
        strategy=Strategy(**strategy) if strategy is not None else None,
        manifest=manifest,
        probe=probe,
    )


def _read_json(directory: Path, name: str, *, optional: bool = False) -> dict | None:
    file = directory / name
    if optional and not file.is_file():
        return None
    if not file.is_file():
        raise CheckpointError(f"{directory}: incomplete checkpoint: {name} is missing")
    try:
        document = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"{file}: not valid JSON") from None
    if not isinstance(document, dict):
        raise CheckpointError(f"{file}: expected a JSON object")
    return document


def load_model_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The full (consolidated) model tensors of a checkpoint, read in this process alone."""
    checkpoint = resolve_checkpoint(path)
    verify_complete(checkpoint)
    metadata = read_dcp_metadata(checkpoint)
    model: dict[str, torch.Tensor] = {}
    for key, entry in metadata.state_dict_metadata.items():
        section, *name_parts = metadata.planner_data[key]
        if section == "model" and isinstance(entry, TensorStorageMetadata):
            model[".".join(map(str, name_parts))] = torch.empty(entry.size, dtype=entry.properties.dtype)
    with _quiet_single_process():
        dcp.load({"model": model}, checkpoint_id=checkpoint, no_dist=True)
    return model


# ---------------------------------------------------------------------------------------------- helpers


def model_and_optimizer_state(
    model_parts: list[nn.Module], optimizer: torch.optim.Optimizer
) -> tuple[dict[str, Any], dict[str, Any]]:
    """This rank's model state and flattened optimizer state (DTensor shards under global FQNs), the
    two dictionaries a checkpoint holds as ``model`` and ``optim``."""
    return get_state_dict(_state_root(model_parts), optimizer, options=STATE_DICT_OPTIONS)


class _PartsView(nn.Module):
    """One module over several model parts of a rank (interleaved pipeline stages) that keeps the
    parameter names of the whole model, so one optimizer over all parts maps to its FQNs. It holds the
    parts' children and direct parameters; ``layers`` dictionaries of different stages are merged."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        for part in parts:
            for name, param in part.named_parameters(recurse=False):
                self.register_parameter(name, param)
            for name, buffer in part.named_buffers(recurse=False):
                self.register_buffer(name, buffer, persistent=name not in part._non_persistent_buffers_set)
            for name, child in part.named_children():
                self.add_module(name, _merge_child(getattr(self, name, None), child, name))


def _merge_child(existing: nn.Module | None, child: nn.Module, name: str) -> nn.Module:
    if existing is None or existing is child or not _has_state(child):
        return existing if existing is not None else child
    if not _has_state(existing):  # stateless modules (dropout) of another part carry no names
        return child
    if isinstance(existing, nn.ModuleDict) and isinstance(child, nn.ModuleDict):
        overlap = set(existing.keys()) & set(child.keys())
        if overlap:
            raise ValueError(f"model parts both hold {name}.{sorted(overlap)[0]}")
        return nn.ModuleDict({**dict(existing.items()), **dict(child.items())})
    raise ValueError(f"model parts both hold a different {name}; cannot give them one set of names")


def _has_state(module: nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def _state_root(model_parts: list[nn.Module]) -> nn.Module:
    parts = list(model_parts)
    if not parts:
        raise ValueError("no model parts")
    return parts[0] if len(parts) == 1 else _PartsView(parts)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _barrier() -> None:
    if _distributed():
        dist.barrier()


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """Silence DCP's warning that it assumes one process: without a process group that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=".*assuming the intent is to (save|load) in a single process"
        )
        yield


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
