"""A Megatron-DeepSpeed stage across nodes: each node's runner starts its share with ``deepspeed --no_ssh``.

CONA's multi-node driver (:mod:`cona.runner.nodes.across_nodes`) gives every node's runner the same stage
specs (shared run directory) and this backend's launcher on each node runs the same launches in the same
order (the verification launch, then training), each with ``--hostfile --no_ssh --node_rank R``. The
hostfile handed to
DeepSpeed only counts processes (with ``--no_ssh`` and an explicit ``--master_addr`` DeepSpeed never
contacts the hosts), so it is written per stage from the topology.

Megatron prints its iteration, evaluation and CONA's hook lines on the last rank only, which lives on the
last node. That node's launcher therefore writes what it parsed (:class:`LastRankView`) next to its log when
its launch ends, and every other node waits for that file: all nodes then reach the same verdict, and node 0
writes the stage result from the same numbers as on one node. Only node 0 writes the stage's result files.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cona.backends.megatron_deepspeed.commands import LaunchPlacement
from cona.backends.megatron_deepspeed.log_parse import Evaluation, MetricsRecorder, Stop
from cona.errors import LaunchError
from cona.runner.launch import ANY_FREE_PORT, Topology, check_port_free, pick_free_port

POLL_S = 0.2


@dataclass(frozen=True, kw_only=True)
class LastRankView:
    """What the last rank printed in one launch, as the stage needs it."""

    evaluations: list[Evaluation]
    last: dict[str, Any] | None
    stop: Stop | None

    @classmethod
    def of(cls, recorder: MetricsRecorder) -> LastRankView:
        return cls(evaluations=list(recorder.evaluations), last=recorder.last, stop=recorder.stop)

    def to_dict(self) -> dict[str, Any]:
        return {
            "evaluations": [dataclasses.asdict(evaluation) for evaluation in self.evaluations],
            "last": self.last,
            "stop": dataclasses.asdict(self.stop) if self.stop is not None else None,
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> LastRankView:
        stop = raw.get("stop")
        return cls(
            evaluations=[Evaluation(**evaluation) for evaluation in raw["evaluations"]],
            last=raw.get("last"),
            stop=Stop(**stop) if stop is not None else None,
        )


def node_file(name: str, topology: Topology) -> str:
    """``megatron.log`` on node 0, ``megatron.node<R>.log`` on node R: the stage directory is shared, and a
    file one node rewrites while another node's processes read it could be read half written."""
    if topology.node_rank == 0:
        return name
    stem, _, suffix = name.rpartition(".")
    return f"{stem}.node{topology.node_rank}.{suffix}"


def placement(stage_dir: Path, topology: Topology) -> LaunchPlacement:
    """Where this node's launcher starts its processes (one node: a free port when none was fixed)."""
    port = topology.master_port
    if port == ANY_FREE_PORT:
        port = pick_free_port()  # the deepspeed launcher has no port 0 of its own
    if topology.node_rank == 0:
        check_port_free(port)  # else the launch fails only after its minutes of start-up
    return LaunchPlacement(
        processes_per_node=topology.nproc_per_node,
        master_port=port,
        master_addr=topology.master_addr or "127.0.0.1",
        hostfile=write_hostfile(stage_dir, topology) if topology.nnodes > 1 else None,
        node_rank=topology.node_rank,
    )


def write_hostfile(stage_dir: Path, topology: Topology) -> Path:
    """DeepSpeed's hostfile for the stage: one line per node with its process count (this node's copy)."""
    path = stage_dir / f"deepspeed_hostfile.node{topology.node_rank}"
    lines = [f"node{rank} slots={topology.nproc_per_node}" for rank in range(topology.nnodes)]
    path.write_text("\n".join(lines) + "\n")
    return path


def holds_last_rank(topology: Topology) -> bool:
    return topology.node_rank == topology.nnodes - 1


def view_path(log: Path) -> Path:
    return log.parent / f"{log.name.split('.')[0]}.last_rank.json"


def forget_view(log: Path, topology: Topology) -> None:
    """The last node, before its launch: a view left by an earlier attempt must not be taken for this
    launch's (the other nodes read it only after a successful launch, which needs the last node's)."""
    if topology.nnodes > 1 and holds_last_rank(topology):
        view_path(log).unlink(missing_ok=True)


def exchange_view(
    log: Path, recorder: MetricsRecorder, topology: Topology, *, succeeded: bool, timeout_s: float, stage: int
) -> LastRankView:
    """What the last rank printed in this launch, on every node."""
    view = LastRankView.of(recorder)
    if topology.nnodes == 1 or not succeeded:
        return view
    if holds_last_rank(topology):
        share_view(log, view)
        return view
    return await_view(log, timeout_s=timeout_s, stage=stage)


def share_view(log: Path, view: LastRankView) -> None:
    """The last node, once its launch ended: the view for the other nodes (atomically)."""
    path = view_path(log)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(view.to_dict()) + "\n")
    os.replace(tmp, path)


def await_view(log: Path, *, timeout_s: float, stage: int) -> LastRankView:
    """The other nodes, once their launch ended: the last node's view (it ends within the timeout)."""
    path = view_path(log)
    deadline = time.monotonic() + timeout_s
    while not path.is_file():
        if time.monotonic() > deadline:
            raise LaunchError(
                f"stage {stage}: the last node reported nothing within {timeout_s:.0f} s ({path} missing; "
                "is the run directory shared by every node?)"
            )
        time.sleep(POLL_S)
    return LastRankView.from_dict(json.loads(path.read_text()))
