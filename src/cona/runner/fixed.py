"""One fixed strategy (``cona train --dp .. --iters N --workdir W``): a one-stage chain.

The run directory is named by the strategy and its ``--iters`` (``fixed-dp2_tp1_pp1_mbs2_gbs8-iters100``)
unless ``--run-name`` names it, so the same command resumes the run as a chain's and an online run's do. The
strategy is the chain of one initial step, built in memory (:func:`fixed_chain`), and run by the stage
driver as every chain is (:func:`cona.runner.schedules.chain_schedule.run_chain`), with ``dp*tp*pp`` workers
under torchrun; the run state names its chain :data:`cona.runner.chain_file.FIXED_ORIGIN` and records its
digest, which the same command rebuilds. The last line says where it stopped and saved. Rerunning the same
command resumes the run from its newest checkpoint (periodic ones included,
``training.save_interval[_minutes]``); ``--fresh`` starts it over; a run directory that holds no fixed run is
refused, as is one made for another strategy, config or ``--workdir`` (the run state says which). The
Megatron-DeepSpeed backend runs its fixed mode the same way.

Across nodes (``--num-nodes K``) a stage needs what a chain run has: a run directory every node agrees on,
node 0 announcing the stage and publishing only when every node left it, and a run state that a rerun
continues from. So the same one-step chain runs there as a chain run (:mod:`cona.commands.train_modes`):
every node's runner builds it from the same flags (node 0 starts the others with them,
:func:`cona.runner.run_descriptions.runner_command`) and derives the same run name; its LR is the one a fixed
run on one node uses (``training.base_lr`` scaled from ``base_gbs`` to the gbs).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from cona import run_files
from cona.engine.spec import StageResult, StageSpec
from cona.errors import LaunchError
from cona.runner.chain_file import FIXED_ORIGIN
from cona.runner.run_descriptions import ChainRun, FixedRun
from cona.runner.run_dir import check_run_name, create_run_dir, point_latest
from cona.runner.state import load_state
from cona.strategy import Strategy

if TYPE_CHECKING:
    from cona.runner.views.console import RunConsole


def fixed_chain(strategy: Strategy, iters: int) -> dict:
    """The chain of one initial step that trains ``strategy`` to iteration ``iters``."""
    step = {"step_num": 1, "dp": strategy.dp, "tp": strategy.tp, "pp": strategy.pp}
    step |= {"gbs": strategy.gbs, "mbs": strategy.mbs, "train_iters": iters, "is_initial": True}
    return {"steps": [step]}


def fixed_run_name(strategy: Strategy, iters: int) -> str:
    """``fixed-dp2_tp1_pp1_mbs2_gbs8-iters100``: the default run name of a fixed strategy trained to
    iteration ``iters`` (a rerun of the same command finds its run by it; another ``--iters`` is another
    run)."""
    layout = f"dp{strategy.dp}_tp{strategy.tp}_pp{strategy.pp}_mbs{strategy.mbs}_gbs{strategy.gbs}"
    return f"fixed-{layout}-iters{iters}"


def open_run_dir(run: FixedRun) -> Path:
    """Make the run's directory, or take the one an earlier run of this name left (which the driver
    resumes, or refuses when it was another strategy or config), and say which on the first line."""
    name = run.run_name or fixed_run_name(run.strategy, run.iters)
    run_dir = Path(run.config.training.logging.log_root).resolve() / check_run_name(name)
    if not run_dir.exists():
        run_dir = create_run_dir(Path(run.config.training.logging.log_root), name)
        print(f"run directory: {run_dir}", flush=True)
        return run_dir
    if not holds_fixed_run(run_dir):
        raise LaunchError(
            f"run directory {run_dir} already exists and holds no fixed run to resume; pick another "
            f"--run-name"
        )
    point_latest(run_dir)
    print(f"run directory: {run_dir} ({'starting over' if run.fresh else 'resuming'})", flush=True)
    return run_dir


def holds_fixed_run(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a fixed run to resume: its run state names the fixed chain, or the chain
    file ``fixed_chain.json`` in which older cona versions kept a fixed run's one step (their run state
    records the digest of the same chain as the one built here, so the run resumes without reading it)."""
    state = load_state(run_dir)
    if state is None:
        return (run_dir / run_files.FIXED_CHAIN).is_file()
    return state.chain_path == FIXED_ORIGIN or Path(state.chain_path).name == run_files.FIXED_CHAIN


def one_stage_chain(run: FixedRun, run_dir: Path) -> ChainRun:
    """The fixed run as the chain of one initial step, built in memory."""
    return ChainRun(
        fixed_chain=fixed_chain(run.strategy, run.iters),
        config=run.config,
        workdir=run.workdir,
        run_dir=run_dir,
        world_size=run.strategy.world_size,
        device_type=run.device_type,
        base_port=run.base_port,
        quiet=run.quiet,
        fresh=run.fresh,
        resume_diverged=run.resume_diverged,
    )


def run_fixed(run: FixedRun, console: RunConsole) -> Path:
    """Train the one stage to ``run.iters`` through the stage driver and print where it stopped; returns
    the run directory."""
    from cona.runner.schedules.chain_schedule import run_chain  # imports torch
    from cona.runner.stage_run import torchrun_launcher

    run_dir = open_run_dir(run)
    run_chain(
        one_stage_chain(run, run_dir), launcher=console.launcher(torchrun_launcher), out=console.message
    )
    spec = StageSpec.read(run_files.spec_path(run_dir, 1))
    result = StageResult.read(spec.result_path)
    print(
        f"stage {result.stage} {result.reason} at iteration {result.last_iteration} "
        f"({result.consumed_tokens:,} tokens); checkpoint: {result.checkpoint}; metrics: {spec.metrics_path}"
    )
    return run_dir
