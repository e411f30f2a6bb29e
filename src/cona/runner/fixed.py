"""One fixed strategy on one node (``cona train --dp .. --iters N --workdir W``): one stage, no run state.

The run directory is new (named by the UTC time and the layout unless ``--run-name`` names it), the stage
spec is written, and ``dp*tp*pp`` workers start under torchrun; the last line says where it stopped and
saved. Across nodes the same strategy runs as a one-stage chain (:mod:`cona.runner.fixed_across_nodes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cona.config import ConaConfig
from cona.engine.spec import StageResult, StageSpec
from cona.runner.launch import DEFAULT_MASTER_PORT_BASE, Topology, run_stage, stage_master_port
from cona.runner.run_dir import create_run_dir, default_run_name, stage_dir
from cona.strategy import Strategy

if TYPE_CHECKING:
    from cona.runner.console import RunConsole


@dataclass(frozen=True, kw_only=True)
class FixedRun:
    """What ``cona train`` with a fixed strategy was asked to do."""

    strategy: Strategy
    iters: int
    """The iteration the stage stops at."""
    config: ConaConfig
    workdir: Path
    """Checkpoints go to ``<workdir>/checkpoints/...`` (absolute)."""
    device_type: str
    """``cpu`` or ``cuda``, as the workers will resolve it."""
    run_name: str | None = None
    """The run directory's name under ``training.log_root``; None: the UTC time and the layout."""
    base_port: int = DEFAULT_MASTER_PORT_BASE
    quiet: bool = False

    def new_run_dir(self) -> Path:
        """Make the run's directory (refusing one that exists) and say which on the first line."""
        strategy = self.strategy
        name = self.run_name or default_run_name(f"dp{strategy.dp}_tp{strategy.tp}_pp{strategy.pp}")
        run_dir = create_run_dir(Path(self.config.training.log_root), name)
        print(f"run directory: {run_dir}", flush=True)
        return run_dir


def run_fixed(run: FixedRun, console: RunConsole) -> StageResult:
    """Train the one stage to ``run.iters`` and print where it stopped; returns its result."""
    from cona.engine.checkpoint import layout_dir
    from cona.runner.run_lock import lock_directory, run_locks
    from cona.runner.stage_run import checkpoint_dtype, stage_lr

    config, strategy = run.config, run.strategy
    run_dir = run.new_run_dir()
    lr = stage_lr(run_dir, config.training, strategy.gbs, 0)
    spec = StageSpec(
        run_dir=run_dir,
        config=config,
        strategy=strategy,
        stage=1,
        workdir=run.workdir,
        target_iteration=run.iters,
        planned_tokens=run.iters * strategy.gbs * config.model.seq,
        # the base LR is the one of training.base_gbs; at another gbs it is scaled as a chain scales it
        lr_factor=lr.lr_factor,
        min_lr_factor=lr.min_lr_factor,
    )
    spec_path = spec.write(stage_dir(run_dir, spec.stage) / "spec.json")
    topology = Topology(
        nproc_per_node=strategy.world_size, master_port=stage_master_port(run.base_port, spec.stage)
    )
    with run_locks(), console.stage(spec) as watch:  # one run at a time on a checkpoint folder
        lock_directory(run_dir, "run directory")
        dtype = checkpoint_dtype(config.training, run.device_type)
        lock_directory(layout_dir(spec.workdir, config, strategy, dtype), "checkpoint folder")
        run_stage(spec_path, spec.stage_dir, topology, device_type=run.device_type, quiet=True, watch=watch)
    result = StageResult.read(spec.result_path)
    print(
        f"stage {result.stage} {result.reason} at iteration {result.last_iteration} "
        f"({result.consumed_tokens:,} tokens); checkpoint: {result.checkpoint}; metrics: {spec.metrics_path}"
    )
    return result
