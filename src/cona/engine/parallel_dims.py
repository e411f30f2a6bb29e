"""Parallel degrees -> checks and the (pp, dp, tp) DeviceMesh.

:func:`validate_layout` is pure (no process group): the workers' check of :mod:`cona.layout_rules`, the rules
the CLI and the runner (which import no torch) apply before anything is launched, and the planner's mask. The
strategy's own fields (zero stage, recompute, sequence parallel, schedule, virtual stages) are what the
engine runs; the config only supplies the model shape.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from cona.config import ModelConfig, TrainingConfig
from cona.layout_rules import LayoutSizes, check_layout
from cona.strategy import Strategy

MESH_DIMS = ("pp", "dp", "tp")


def validate_layout(
    model: ModelConfig, training: TrainingConfig, strategy: Strategy, world_size: int | None = None
) -> None:
    """Raise :class:`~cona.errors.LayoutError` saying why ``strategy`` cannot train ``model`` (on
    ``world_size`` ranks); the rules are :mod:`cona.layout_rules`, the ones the planner applies too.
    ``training`` is not read: the strategy carries every execution setting the rules look at."""
    check_layout(LayoutSizes.of_config(model), strategy, world_size)


def build_mesh(strategy: Strategy, device_type: str) -> DeviceMesh:
    """The one DeviceMesh of a run, dims ("pp", "dp", "tp") (tp innermost: fastest links)."""
    return init_device_mesh(device_type, (strategy.pp, strategy.dp, strategy.tp), mesh_dim_names=MESH_DIMS)
