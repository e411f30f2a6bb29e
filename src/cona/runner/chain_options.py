"""What ``cona train --chain`` was asked to do: the options of a chain run, from the command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

from cona.config import ConaConfig, TrainingConfig, load_config
from cona.errors import ChainError
from cona.runner.across_nodes import node_topology
from cona.runner.launch import DEFAULT_MASTER_PORT_BASE, Topology, resolve_port_base
from cona.runner.multinode import NodePlacement, resolve_placement
from cona.runner.run_dir import check_run_name, check_workdir, resolve_log_root


@dataclass(frozen=True, kw_only=True)
class ChainRun:
    """What ``cona train --chain`` was asked to do."""

    chain_path: Path
    config: ConaConfig
    workdir: Path
    """Checkpoints go to ``<workdir>/checkpoints/...``."""
    run_dir: Path
    world_size: int
    device_type: str
    """``cpu`` or ``cuda``; decides the checkpoint dtype directory (CPU trains in fp32)."""
    base_port: int | None = DEFAULT_MASTER_PORT_BASE
    """Stage N rendezvous on port ``base_port + N``; None: torchrun picks a free port (one node only)."""
    fresh: bool = False
    """Discard the run directory's state and start the chain over."""
    quiet: bool = False
    """No per-interval console lines from the workers."""
    nodes: NodePlacement = NodePlacement()
    """Where this node stands in a multi-node run (one node by default)."""


PLACEMENT_FLAGS = ("num_nodes", "gpus_per_node", "gpus", "hostfile", "master_addr", "node_rank", "no_ssh")


def chain_run_from_args(args: argparse.Namespace) -> ChainRun:
    """Options from ``cona train --chain FILE [--config] [--device] [--workdir] [--gpus | --num-nodes
    --gpus-per-node] [--run-name] [--master-port-base] [--quiet] [--fresh]``."""
    config = resolve_log_root(load_config(getattr(args, "config", None), check_data_files=True))
    if getattr(args, "device", None) is not None:
        config = dataclasses.replace(
            config, training=dataclasses.replace(config.training, device=args.device)
        )
    device_type = _device_type(config.training)
    nodes = resolve_placement({name: getattr(args, name, None) for name in PLACEMENT_FLAGS}, os.environ)
    chain_path = Path(args.chain)
    run_name = check_run_name(getattr(args, "run_name", None) or f"chain-{chain_path.stem}")
    return ChainRun(
        chain_path=chain_path,
        config=config,
        workdir=check_workdir(Path(getattr(args, "workdir", None) or Path.cwd())),
        run_dir=Path(config.training.log_root) / run_name,
        world_size=nodes.num_nodes * nodes.gpus_per_node
        if nodes.num_nodes > 1
        else _world_size(args, device_type),
        device_type=device_type,
        base_port=resolve_port_base(getattr(args, "master_port_base", None), nodes.num_nodes),
        fresh=bool(getattr(args, "fresh", False)),
        quiet=bool(getattr(args, "quiet", False)),
        nodes=nodes,
    )


def stage_topology(run: ChainRun, port: int) -> Topology:
    """This node's part of every stage: all processes, or one node's share of a multi-node run."""
    return node_topology(run.nodes, run.world_size, port)


def _device_type(training: TrainingConfig) -> str:
    if training.device != "auto":
        return training.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _world_size(args: argparse.Namespace, device_type: str) -> int:
    gpus, per_node = getattr(args, "gpus", None), getattr(args, "gpus_per_node", None)
    if gpus is not None:
        return gpus
    if per_node is not None:
        return (getattr(args, "num_nodes", None) or 1) * per_node
    if device_type == "cuda":
        import torch

        return torch.cuda.device_count()
    first = _first_step_world_size(Path(args.chain))
    if first is None:
        raise ChainError("--chain needs the process count: pass --gpus N (on CPU, N worker processes)")
    return first  # the original CONA command line (no --gpus) on CPU: the first step's dp*tp*pp


def _first_step_world_size(chain_path: Path) -> int | None:
    """dp * tp * pp of the chain file's first step (None when the file does not say; loading the chain
    later names what is wrong with it)."""
    try:
        step = json.loads(chain_path.read_text())["steps"][0]
        return int(step.get("dp", 1)) * int(step.get("tp", 1)) * int(step.get("pp", 1))
    except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None
