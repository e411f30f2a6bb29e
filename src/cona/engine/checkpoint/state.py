"""The state dictionaries a checkpoint holds, and the process-group helpers of saving and loading.

``model_and_optimizer_state`` gives this rank's model state and flattened optimizer state (DTensor shards
under global FQNs); a rank with several model parts (interleaved pipeline stages) sees them as one module
(:class:`_PartsView`) that keeps the whole model's parameter names.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

STATE_DICT_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def model_and_optimizer_state(
    model_parts: list[nn.Module], optimizer: torch.optim.Optimizer
) -> tuple[dict[str, Any], dict[str, Any]]:
    """This rank's model state and flattened optimizer state (DTensor shards under global FQNs), the
    two dictionaries a checkpoint holds as ``model`` and ``optim``."""
    return get_state_dict(state_root(model_parts), optimizer, options=STATE_DICT_OPTIONS)


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


def state_root(model_parts: list[nn.Module]) -> nn.Module:
    parts = list(model_parts)
    if not parts:
        raise ValueError("no model parts")
    return parts[0] if len(parts) == 1 else _PartsView(parts)


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if distributed() else 1


def barrier() -> None:
    if distributed():
        dist.barrier()


def gather(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order (just ``[value]`` without a process group)."""
    if not distributed():
        return [value]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone
