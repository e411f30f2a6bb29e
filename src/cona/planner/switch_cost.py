"""The predicted cost of a strategy switch (pure): in place when only the batch changes, else a checkpoint.

A switch that keeps the layout (dp, tp, pp; the batch sizes may change) runs in place: the same processes
rebuild the batch-dependent parts and take one step at the new shape (``IN_PLACE_S``). A layout change saves
a checkpoint and loads it into the new layout in the same worker processes: the model and AdamW state
(``STATE_BYTES_PER_PARAMETER``) is written and read at the storage rates below, each node writing and
reading its own share in parallel, plus the rebuild of the new stage's model, optimizer and data
(``REBUILD_S``).

The rates come from CONA's own switch on one H200 (docs/benchmarks.md, "Switch cost of a chain": a 350M
model's 4.3 GB checkpoint saved in 9.6 s and loaded, with the new stage built, in 6.1 s, with the worker
processes kept); nothing in them is measured on several nodes, where a shared file system may be slower.
"""

from __future__ import annotations

from cona.config import ModelConfig
from cona.planner.flops import parameter_count
from cona.strategy import Strategy

STATE_BYTES_PER_PARAMETER = 12.0
"""fp32 weights plus AdamW's two fp32 moments, as the checkpoint stores them (4.3 GB for 355M parameters)."""
SAVE_GBPS_PER_NODE = 0.45
"""Checkpoint write rate of one node, GB/s (4.3 GB in 9.6 s)."""
LOAD_GBPS_PER_NODE = 0.9
"""Checkpoint read rate of one node, GB/s (4.3 GB in the 6.1 s load less ``REBUILD_S``)."""
REBUILD_S = 1.3
"""Building the new stage's model, optimizer and data and its first step, seconds."""
IN_PLACE_S = 1.0
"""A switch that keeps the layout: the batch-dependent parts rebuilt and one step at the new shape."""


def predicted_switch_cost_s(model: ModelConfig, old: Strategy, new: Strategy, gpus_per_node: int) -> float:
    """Seconds a switch from ``old`` to ``new`` costs (0 when they are the same strategy)."""
    if old == new:
        return 0.0
    if old.same_layout(new):
        return IN_PLACE_S
    nodes = max(1, -(-new.world_size // gpus_per_node))
    state_gb = parameter_count(model) * STATE_BYTES_PER_PARAMETER / 1e9
    return REBUILD_S + state_gb / (SAVE_GBPS_PER_NODE * nodes) + state_gb / (LOAD_GBPS_PER_NODE * nodes)
