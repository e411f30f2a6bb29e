"""A fixed strategy across nodes (``cona train --dp .. --iters N --num-nodes K ..``): a one-stage chain.

Across nodes a stage needs what a chain run has: a run directory every node agrees on, node 0 announcing the
stage and publishing only when every node left it, and a run state that a rerun continues from. So the fixed
strategy is written as the chain of one initial step (:func:`write_fixed_chain`) and run by
:func:`cona.runner.schedules.chain_schedule.run_chain`; its LR is the one single-node fixed mode uses too
(``training.base_lr`` scaled from ``base_gbs`` to the gbs). Its default run name is the strategy's, as on
one node: the same on every node, and the same for a rerun, which resumes the run.
"""

from __future__ import annotations

from pathlib import Path

from cona import run_files
from cona.atomic_files import write_json_atomic
from cona.config import ConaConfig
from cona.runner.run_dir import check_run_name
from cona.strategy import Strategy


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


def write_chain(path: Path, chain: dict) -> None:
    """Every node writes the same content; the atomic write keeps a reader on another node from seeing
    half (each writer has its own temporary)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, chain)


def write_fixed_chain(
    config: ConaConfig, strategy: Strategy, iters: int, run_name: str | None
) -> tuple[Path, str]:
    """Write the strategy's one-stage chain into its run directory; returns the chain file and run name."""
    name = check_run_name(run_name or fixed_run_name(strategy, iters))
    chain_path = Path(config.training.log_root) / name / run_files.FIXED_CHAIN
    write_chain(chain_path, fixed_chain(strategy, iters))
    return chain_path, name
