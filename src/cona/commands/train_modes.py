"""The modes of ``cona train`` and ``cona.train``: one fixed strategy, a chain (``chain``) or online search
(``gpus`` alone), from settings named as ``cona train``'s flags.

The settings become a typed run description (:mod:`cona.commands.train_runs`) and nothing below this module
sees them; every mode then runs through the one stage driver (:mod:`cona.runner.driver`): a chain from its
file (:mod:`cona.runner.schedules.chain_schedule`; a fixed strategy is a one-stage chain, its layout checked
before anything is launched), online mode from the policy (:mod:`cona.runner.schedules.online`). Every mode
also runs across nodes (--num-nodes, --hostfile; :mod:`cona.runner.nodes.across_nodes`). ``--backend
megatron-deepspeed --repo-path PATH`` (``--repo-path`` alone implies it) runs the fixed and chain modes
through a Megatron-DeepSpeed checkout (:mod:`cona.backends.megatron_deepspeed`).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cona.commands.train_runs import chain_run, fixed_run, fixed_strategy, flag, online_run, system_warning
from cona.errors import UsageError
from cona.layout_rules import LayoutSizes, check_layout

if TYPE_CHECKING:
    from cona.backends.megatron_deepspeed.environment import MdsEnvironment
    from cona.runner.stage_run import Launcher
    from cona.runner.views.console import RunConsole

FIXED_STRATEGY_FLAGS = ("dp", "tp", "pp", "gbs", "mbs", "iters")
MULTI_NODE_FLAGS = ("num_nodes", "gpus_per_node", "hostfile", "master_addr", "node_rank", "no_ssh")
ONLINE_FLAGS = (
    "system", "initial_gbs", "max_gbs", "total_iters", "total_tokens", "target_ppl", "botorch", "no_botorch"
)  # fmt: skip


def run_training(args: Any) -> Path | None:
    """Run the mode ``args`` asks for (flags by their ``cona train`` names; a flag not there counts as not
    given) to its end; returns the run directory (None where the backend does not say it)."""
    with _stopped_by_signals():  # SIGTERM/SIGINT stop the workers and leave the run resumable
        mds = _megatron_deepspeed(args)
        if flag(args, "chain") is not None:
            return _train_chain(args, mds)
        if flag(args, "gpus") is not None or _given(args, ONLINE_FLAGS):
            return _train_online(args, mds)
        return _train_fixed(args, mds)


def _stopped_by_signals() -> AbstractContextManager:
    """:func:`~cona.runner.signals.stop_on_signals` where signal handlers can be set (the main thread: a
    notebook's cells run there); another thread's run stops with its interpreter."""
    from cona.runner.signals import stop_on_signals

    return stop_on_signals() if threading.current_thread() is threading.main_thread() else nullcontext()


def _given(args: Any, names: tuple[str, ...]) -> list[str]:
    """The flags among ``names`` that the command line gave."""
    return [f"--{name.replace('_', '-')}" for name in names if flag(args, name) is not None]


def _train_chain(args: Any, mds: bool) -> Path:
    for names in (FIXED_STRATEGY_FLAGS, ONLINE_FLAGS):
        given = _given(args, names)
        if given:
            raise UsageError(
                f"cona train: --chain takes the strategies from the chain file; drop {', '.join(given)}"
            )
    if mds:
        from cona.backends.megatron_deepspeed.run import run_mds_chain

        run = chain_run(args)
        run_mds_chain(run, _mds_environment(args), keep_workers=not bool(flag(args, "restart_workers")))
        return run.run_dir
    from cona.runner.schedules.chain_schedule import run_chain  # imports torch: not at `cona --help`

    run = chain_run(args)
    with _console_and_launcher(args) as (console, launcher):
        run_chain(run, launcher=launcher, out=console.message)
    return run.run_dir


def _train_online(args: Any, mds: bool) -> Path:
    _refuse_switch_in_place(args)
    others = _given(args, FIXED_STRATEGY_FLAGS)
    if others:
        raise UsageError(
            "cona train: online mode (--gpus or --num-nodes without --chain) chooses the strategies; "
            f"drop {', '.join(others)}"
        )
    run = online_run(args)
    warning = system_warning(run)
    if warning is not None:
        print(f"cona: warning: {warning}", file=sys.stderr, flush=True)
    if mds:
        from cona.backends.megatron_deepspeed.run import BACKEND_NAME, run_mds_online

        run = dataclasses.replace(run, backend=BACKEND_NAME)
        run_mds_online(run, _mds_environment(args), in_place=not bool(flag(args, "restart_workers")))
        return run.run_dir
    from cona.runner.schedules.online import run_online  # imports torch: not at `cona --help` time

    with _console_and_launcher(args) as (console, launcher):
        run_online(run, launcher=launcher, out=console.message)
    return run.run_dir


@contextmanager
def _console_and_launcher(args: Any) -> Iterator[tuple[RunConsole, Launcher]]:
    """The console of a chain or online run and its stage launcher (a worker session unless
    ``--restart-workers``), shown through the console."""
    from cona.runner.views.console import RunConsole
    from cona.runner.worker_session import stage_launcher

    console = RunConsole.for_stdout(quiet=bool(flag(args, "quiet")))
    with stage_launcher(restart_workers=bool(flag(args, "restart_workers"))) as launcher:
        yield console, console.launcher(launcher)


def _train_fixed(args: Any, mds: bool) -> Path | None:
    online = _given(args, ONLINE_FLAGS)
    if online:
        raise UsageError(f"cona train: {', '.join(online)} go with --gpus (online mode)")
    across_nodes = [
        f"--{name.replace('_', '-')}" for name in MULTI_NODE_FLAGS if flag(args, name) not in (None, False)
    ]
    _refuse_for_one_stage(args)
    config, strategy = fixed_strategy(args)
    from cona.runner.views.console import RunConsole

    console = RunConsole.for_stdout(quiet=bool(flag(args, "quiet")))
    check_layout(LayoutSizes.of_config(config.model), strategy, strategy.world_size)
    if across_nodes:  # a one-stage chain; each node checks its own GPUs
        from cona.runner.fixed import fixed_chain, fixed_run_name
        from cona.runner.run_dir import check_run_name
        from cona.runner.schedules.chain_schedule import run_chain, torchrun_launcher

        name = check_run_name(flag(args, "run_name") or fixed_run_name(strategy, args.iters))
        run = chain_run(args, fixed=(fixed_chain(strategy, args.iters), name))
        if mds:
            from cona.backends.megatron_deepspeed.run import run_mds_chain

            run_mds_chain(run, _mds_environment(args))
            return run.run_dir
        run_chain(run, launcher=console.launcher(torchrun_launcher), out=console.message)
        return run.run_dir
    run = fixed_run(args, config, strategy)
    if mds:
        from cona.backends.megatron_deepspeed.run import train_fixed

        train_fixed(run, _mds_environment(args))
        return None
    from cona.runner.fixed import run_fixed

    return run_fixed(run, console)


def _refuse_for_one_stage(args: Any) -> None:
    """What a single fixed stage cannot take, and the fixed strategy's flags it needs."""
    if bool(flag(args, "restart_workers")):  # one stage: there is nothing to restart
        raise UsageError("cona train: --restart-workers goes with --chain or online mode")
    _refuse_switch_in_place(args)
    missing = [f"--{name}" for name in FIXED_STRATEGY_FLAGS if flag(args, name) is None]
    if missing:
        raise UsageError(
            f"cona train: missing {', '.join(missing)} (a fixed strategy needs --dp --tp --pp "
            f"--gbs --mbs --iters)"
        )


def _refuse_switch_in_place(args: Any) -> None:
    if flag(args, "switch_in_place"):
        raise UsageError(
            "cona train: --switch-in-place goes with --chain (online mode switches in place whenever the "
            "layout stays and the workers are kept)"
        )


def _mds_environment(args: Any) -> MdsEnvironment:
    from cona.backends.megatron_deepspeed.environment import resolve_environment

    return resolve_environment(
        flag(args, "repo_path"), flag(args, "mds_python"), flag(args, "mds_shim"), os.environ
    )


def _megatron_deepspeed(args: Any) -> bool:
    """Whether the run goes through a Megatron-DeepSpeed checkout (``--repo-path`` alone implies it)."""
    if flag(args, "backend") == "native" and flag(args, "repo_path") is not None:
        raise UsageError(
            "cona train: --repo-path names a Megatron-DeepSpeed checkout; drop it or --backend native"
        )
    mds = flag(args, "backend") == "megatron-deepspeed" or flag(args, "repo_path") is not None
    if not mds and (flag(args, "mds_python") is not None or flag(args, "mds_shim") is not None):
        raise UsageError("cona train: --mds-python and --mds-shim go with --backend megatron-deepspeed")
    return mds
