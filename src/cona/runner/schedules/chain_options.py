"""What ``cona train --chain`` was asked to do: the description of a chain run (made from the flags by
:mod:`cona.commands.train_runs`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cona.config import ConaConfig
from cona.runner.launch import DEFAULT_MASTER_PORT_BASE
from cona.runner.nodes.multinode import NodePlacement, cona_command


@dataclass(frozen=True, kw_only=True)
class ChainRun:
    """What ``cona train --chain`` was asked to do."""

    chain_path: Path
    config: ConaConfig
    workdir: Path
    """Checkpoints go to ``<workdir>/checkpoints/<run_dir.name>/...``."""
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
    resume_diverged: bool = False
    """Relaunch a stage whose last attempt stopped because training diverged (else it is refused)."""
    nodes: NodePlacement = NodePlacement()
    """Where this node stands in a multi-node run (one node by default)."""
    switch_in_place: bool = False
    """A step that keeps the previous step's layout continues the state in the workers' memory (when the
    launcher keeps its workers, see :mod:`cona.runner.worker_session`) instead of saving, publishing and
    loading a checkpoint; a layout change always goes through the checkpoint and its verification."""


def runner_command(run: ChainRun) -> list[str]:
    """The ``cona train --chain`` command of this run, for the runners node 0 starts on the other hosts."""
    return cona_command(
        ["--chain", str(run.chain_path.resolve())],
        config=run.config,
        nodes=run.nodes,
        run_dir=run.run_dir,
        workdir=run.workdir,
        base_port=run.base_port,
        quiet=run.quiet,
    )
