"""Any mode of ``cona train`` across nodes: node 0 drives, the other nodes run what it announces.

A chain, an online run and a fixed strategy differ only in how node 0 decides its stages (a chain file, the
online search, one stage). What every node does is the same (:mod:`cona.runner.nodes.multinode_sync`): node
0's
runner hosts the runners' store on the port base and wraps its stage launcher so that each stage is
announced there to the other nodes' runners, which start their share of its workers, and the checkpoint is
published only once every node reported leaving training. The other nodes therefore never need the mode's
decision logic, only the stage specs node 0 writes to the shared run directory: :func:`run_across_nodes`
takes node 0's driver as a function of the launcher.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from cona.engine.spec import StageSpec
from cona.runner.launch import Topology
from cona.runner.nodes.multinode import NodePlacement, RemoteRunners
from cona.runner.nodes.multinode_sync import Coordinator, follow
from cona.runner.nodes.runners_store import store_port
from cona.runner.stage_run import Launcher, StageLaunch
from cona.runner.state import RunState, load_state


def node_topology(nodes: NodePlacement, world_size: int, port: int) -> Topology:
    """This node's part of a stage: all ``world_size`` processes, or one node's share across nodes."""
    if nodes.num_nodes == 1:
        return Topology(nproc_per_node=world_size, master_port=port)
    return Topology(
        nproc_per_node=nodes.gpus_per_node,
        master_port=port,
        master_addr=nodes.master_addr,
        nnodes=nodes.num_nodes,
        node_rank=nodes.node_rank,
    )


def run_across_nodes(
    *,
    run_dir: Path,
    nodes: NodePlacement,
    base_port: int | None,
    timeout_s: float,
    world_size: int,
    device_type: str,
    quiet: bool,
    launcher: Launcher,
    out: Callable[[str], None],
    remote_command: Sequence[str],
    drive: Callable[[Launcher], RunState],
) -> RunState:
    """Node 0: ``drive(coordinated_launcher)`` (starting the other runners over ssh unless ``--no-ssh``);
    node r > 0: run every stage node 0 announces until it says the run ended, then return the run state.
    The runners agree through a store on ``base_port`` itself (stage N's torchrun uses ``base_port + N``)."""
    port = store_port(base_port)
    if nodes.node_rank > 0:

        def run_local(stage: int, spec_path: Path, port: int, watch: Callable[[], None]) -> None:
            launcher(
                StageLaunch(
                    spec=StageSpec.read(spec_path),
                    spec_path=spec_path,
                    topology=node_topology(nodes, world_size, port),
                    device_type=device_type,
                    quiet=quiet,
                    watch=watch,
                )
            )

        follow(nodes, port=port, timeout_s=timeout_s, run_local=run_local, out=out)
        return load_state(run_dir)
    remote = (
        RemoteRunners(nodes, list(remote_command), cwd=Path.cwd(), env=os.environ, out=out)
        if nodes.ssh
        else None
    )
    with Coordinator(nodes, port=port, timeout_s=timeout_s, out=out, remote=remote) as coordinator:

        def coordinated(launch: StageLaunch) -> None:
            coordinator.run_stage(
                launch.spec.stage,
                launch.spec_path,
                launch.topology.master_port,
                lambda watch: launcher(dataclasses.replace(launch, watch=watch)),
            )

        return drive(coordinated)
