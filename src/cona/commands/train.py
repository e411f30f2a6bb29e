"""``cona train``: one fixed strategy (``--dp D --tp T --pp P --gbs G --mbs M --iters N [--workdir W]``), a
chain (``--chain FILE``) or online search (``--gpus N`` alone).

The flags become a typed run description (:mod:`cona.commands.train_runs`) and nothing below this module
sees them; every mode then runs through the one stage driver (:mod:`cona.runner.driver`): a chain from its
file (:mod:`cona.runner.schedules.sequence`; a fixed strategy is a one-stage chain, its layout checked before
anything
is launched), online mode from the policy (:mod:`cona.runner.schedules.online`). Every mode also runs across
nodes
(--num-nodes, --hostfile; :mod:`cona.runner.nodes.across_nodes`). ``--backend megatron-deepspeed --repo-path
PATH``
(``--repo-path`` alone implies it) runs the fixed and chain modes through a Megatron-DeepSpeed checkout
(:mod:`cona.backends.megatron_deepspeed`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from cona.commands.config_flags import add_config_flags
from cona.commands.flag_types import finite_float, port_base, positive_int
from cona.commands.search_flags import add_search_flags
from cona.commands.train_runs import chain_run, fixed_run, fixed_strategy, online_run
from cona.errors import UsageError
from cona.layout_rules import LayoutSizes, check_layout
from cona.runner.launch import DEFAULT_MASTER_PORT_BASE

if TYPE_CHECKING:
    from cona.backends.megatron_deepspeed.environment import MdsEnvironment
    from cona.runner.stage_run import Launcher
    from cona.runner.views.console import RunConsole

FIXED_STRATEGY_FLAGS = ("dp", "tp", "pp", "gbs", "mbs", "iters")
MULTI_NODE_FLAGS = ("num_nodes", "gpus_per_node", "hostfile", "master_addr", "node_rank", "no_ssh")
BACKENDS = ("native", "megatron-deepspeed")
ONLINE_FLAGS = (
    "system", "initial_gbs", "max_gbs", "total_iters", "total_tokens", "target_ppl", "botorch", "no_botorch"
)  # fmt: skip


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "train",
        help="Train: a fixed strategy, a strategy chain (--chain) or online strategy chaining (--gpus)",
        description="Train in one of three modes. Fixed strategy: --dp --tp --pp --gbs --mbs --iters "
        "(dp*tp*pp CPU processes or GPUs). Strategy chain: --chain FILE, its steps one after another. "
        "Online strategy chaining: --gpus N --system S --initial-gbs G with a budget (--total-iters, "
        "--total-tokens or --target-ppl); the search chooses and switches the strategies while training. "
        "Checkpoints go under --workdir (default: the current directory) in every mode.",
    )
    fixed = parser.add_argument_group("fixed strategy")
    for name, help_text in (
        ("dp", "data-parallel degree"),
        ("tp", "tensor-parallel degree"),
        ("pp", "pipeline-parallel degree"),
        ("gbs", "global batch size (samples)"),
        ("mbs", "micro-batch size per data-parallel rank"),
        ("iters", "iterations to train"),
    ):
        fixed.add_argument(
            f"--{name}", type=positive_int, default=None, metavar=name[0].upper(), help=help_text
        )
    parser.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="checkpoints go to WORKDIR/checkpoints/<run name>/... in every mode (default: the current "
        "directory)",
    )
    add_config_flags(parser)
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default=None,
        help="overrides training.device of the config",
    )
    parser.add_argument(
        "--run-name",
        default=None,
        help="run directory name under training.log_root (default: UTC time + strategy)",
    )
    parser.add_argument(
        "--master-port-base",
        type=port_base,
        default=None,
        help="stage N rendezvous on port BASE+N (default: on one node torchrun picks a free port for every "
        f"stage; across nodes {DEFAULT_MASTER_PORT_BASE})",
    )
    parser.add_argument(
        "--quiet",
        action="store_true",
        help="only stage start/finish/switch lines and errors (no live progress)",
    )
    _add_chain_flags(parser)
    _add_online_flags(parser)
    _add_multi_node_flags(parser)
    _add_backend_flags(parser)
    parser.set_defaults(func=_train)


def _add_chain_flags(parser: argparse.ArgumentParser) -> None:
    chain = parser.add_argument_group("strategy chain")
    chain.add_argument(
        "--chain",
        type=Path,
        default=None,
        metavar="FILE",
        help="train through the strategies of a chain file",
    )
    chain.add_argument(
        "--gpus", type=int, default=None, help="processes of every stage: GPUs, or CPU workers"
    )
    chain.add_argument(
        "--fresh",
        action="store_true",
        help="discard the run's state and start it over (else the same command resumes the run)",
    )
    chain.add_argument(
        "--resume-diverged",
        action="store_true",
        help="resume a run whose last attempt stopped because training diverged (else refused)",
    )
    chain.add_argument(
        "--switch-in-place",
        action="store_true",
        help="a chain step that keeps the previous step's layout continues the state in the workers' memory "
        "instead of through a checkpoint (a layout change is always checkpointed and verified)",
    )
    chain.add_argument(
        "--restart-workers",
        action="store_true",
        help="start new worker processes for every stage of a chain or online run (by default consecutive "
        "stages on one node reuse the processes; the switch still saves and loads the checkpoint)",
    )


def _add_backend_flags(parser: argparse.ArgumentParser) -> None:
    backend = parser.add_argument_group("backend (docs/megatron-deepspeed.md)")
    backend.add_argument(
        "--backend", choices=BACKENDS, default=None, help="native (default) or megatron-deepspeed"
    )
    backend.add_argument(
        "--repo-path", default=None, help="Megatron-DeepSpeed checkout (implies --backend megatron-deepspeed)"
    )
    backend.add_argument(
        "--mds-python", default=None, help="the checkout's Python (default: $CONA_MEGATRON_DEEPSPEED_PYTHON)"
    )
    backend.add_argument(
        "--mds-shim", default=None, help="import-shim folder (default: $CONA_MEGATRON_DEEPSPEED_SHIM)"
    )


def _add_online_flags(parser: argparse.ArgumentParser) -> None:
    online = parser.add_argument_group("online strategy chaining (--gpus without --chain)")
    online.add_argument(
        "--system", default=None, help="system the performance model plans for (cona systems lists them)"
    )
    online.add_argument("--initial-gbs", type=int, default=None, help="global batch size of the first stage")
    online.add_argument(
        "--max-gbs", type=int, default=None, help="largest gbs a switch may reach (default: --initial-gbs)"
    )
    online.add_argument("--total-iters", type=int, default=None, help="stop after this many iterations")
    online.add_argument("--total-tokens", type=int, default=None, help="stop after this many tokens")
    online.add_argument(
        "--target-ppl",
        type=finite_float,
        default=None,
        help="stop at the first evaluation with perplexity <= this",
    )
    add_search_flags(online)


def _add_multi_node_flags(parser: argparse.ArgumentParser) -> None:
    nodes = parser.add_argument_group("multi-node (any mode; run the same command on every node)")
    nodes.add_argument("--num-nodes", type=positive_int, default=None, help="nodes (with --gpus-per-node)")
    nodes.add_argument(
        "--gpus-per-node", type=positive_int, default=None, help="GPUs (or CPU workers) per node"
    )
    nodes.add_argument(
        "--hostfile", default=None, help="DeepSpeed hostfile: '<host> slots=<gpus-per-node>' per line"
    )
    nodes.add_argument("--master-addr", default=None, help="node 0's address, one of the hostfile's")
    nodes.add_argument("--node-rank", type=int, default=None, help="this node's rank (with --no-ssh)")
    nodes.add_argument(
        "--no-ssh",
        action="store_true",
        help="every node is started by hand (else node 0 starts them over ssh)",
    )


def _train(args: argparse.Namespace) -> int:
    from cona.runner.signals import stop_on_signals

    with stop_on_signals():  # SIGTERM/SIGINT/SIGHUP stop the workers, leaving the run resumable
        mds = _megatron_deepspeed(args)
        if args.chain is not None:
            _train_chain(args, mds)
        elif args.gpus is not None or _given(args, ONLINE_FLAGS):
            _train_online(args, mds)
        else:
            _train_fixed(args, mds)
    return 0


def _given(args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    """The flags among ``names`` that the command line gave."""
    return [f"--{name.replace('_', '-')}" for name in names if getattr(args, name) is not None]


def _train_chain(args: argparse.Namespace, mds: bool) -> None:
    for names in (FIXED_STRATEGY_FLAGS, ONLINE_FLAGS):
        given = _given(args, names)
        if given:
            raise UsageError(
                f"cona train: --chain takes the strategies from the chain file; drop {', '.join(given)}"
            )
    if mds:
        from cona.backends.megatron_deepspeed.run import run_mds_chain

        environment = _mds_environment(args)
        run_mds_chain(chain_run(args), environment, keep_workers=not getattr(args, "restart_workers", False))
        return
    from cona.runner.schedules.sequence import run_chain  # imports torch: not at `cona --help`

    with _console_and_launcher(args) as (console, launcher):
        run_chain(chain_run(args), launcher=launcher, out=console.message)


def _train_online(args: argparse.Namespace, mds: bool) -> None:
    _refuse_switch_in_place(args)
    others = _given(args, FIXED_STRATEGY_FLAGS)
    if others:
        raise UsageError(
            "cona train: online mode (--gpus or --num-nodes without --chain) chooses the strategies; "
            f"drop {', '.join(others)}"
        )
    if mds:
        from cona.backends.megatron_deepspeed.run import BACKEND_NAME, run_mds_online

        run = dataclasses.replace(online_run(args), backend=BACKEND_NAME)
        run_mds_online(run, _mds_environment(args), in_place=not getattr(args, "restart_workers", False))
        return
    from cona.runner.schedules.online import run_online  # imports torch: not at `cona --help` time

    with _console_and_launcher(args) as (console, launcher):
        run_online(online_run(args), launcher=launcher, out=console.message)


@contextmanager
def _console_and_launcher(args: argparse.Namespace) -> Iterator[tuple[RunConsole, Launcher]]:
    """The console of a chain or online run and its stage launcher (a worker session unless
    ``--restart-workers``), shown through the console."""
    from cona.runner.views.console import RunConsole
    from cona.runner.worker_session import stage_launcher

    console = RunConsole.for_stdout(quiet=args.quiet)
    with stage_launcher(restart_workers=getattr(args, "restart_workers", False)) as launcher:
        yield console, console.launcher(launcher)


def _train_fixed(args: argparse.Namespace, mds: bool) -> None:
    online = _given(args, ONLINE_FLAGS)
    if online:
        raise UsageError(f"cona train: {', '.join(online)} go with --gpus (online mode)")
    across_nodes = [
        f"--{name.replace('_', '-')}" for name in MULTI_NODE_FLAGS if getattr(args, name) not in (None, False)
    ]
    _refuse_for_one_stage(args)
    config, strategy = fixed_strategy(args)
    from cona.runner.views.console import RunConsole

    console = RunConsole.for_stdout(quiet=args.quiet)
    check_layout(LayoutSizes.of_config(config.model), strategy, strategy.world_size)
    if across_nodes:  # a one-stage chain; each node checks its own GPUs
        from cona.runner.nodes.fixed_across_nodes import write_fixed_chain
        from cona.runner.schedules.sequence import run_chain, torchrun_launcher

        chain_path, run_name = write_fixed_chain(config, strategy, args.iters, args.run_name)
        run = chain_run(args, chain=chain_path, run_name=run_name)
        if mds:
            from cona.backends.megatron_deepspeed.run import run_mds_chain

            run_mds_chain(run, _mds_environment(args))
            return
        run_chain(run, launcher=console.launcher(torchrun_launcher), out=console.message)
        return
    run = fixed_run(args, config, strategy)
    if mds:
        from cona.backends.megatron_deepspeed.run import train_fixed

        train_fixed(run, _mds_environment(args))
        return
    from cona.runner.fixed import run_fixed

    run_fixed(run, console)


def _refuse_for_one_stage(args: argparse.Namespace) -> None:
    """What a single fixed stage cannot take, and the fixed strategy's flags it needs."""
    if getattr(args, "restart_workers", False):  # one stage: there is nothing to restart
        raise UsageError("cona train: --restart-workers goes with --chain or online mode")
    _refuse_switch_in_place(args)
    missing = [f"--{name}" for name in FIXED_STRATEGY_FLAGS if getattr(args, name) is None]
    if missing:
        raise UsageError(
            f"cona train: missing {', '.join(missing)} (a fixed strategy needs --dp --tp --pp "
            f"--gbs --mbs --iters)"
        )


def _refuse_switch_in_place(args: argparse.Namespace) -> None:
    if getattr(args, "switch_in_place", False):
        raise UsageError(
            "cona train: --switch-in-place goes with --chain (online mode switches in place whenever the "
            "layout stays and the workers are kept)"
        )


def _mds_environment(args: argparse.Namespace) -> MdsEnvironment:
    from cona.backends.megatron_deepspeed.environment import resolve_environment

    return resolve_environment(args.repo_path, args.mds_python, args.mds_shim, os.environ)


def _megatron_deepspeed(args: argparse.Namespace) -> bool:
    """Whether the run goes through a Megatron-DeepSpeed checkout (``--repo-path`` alone implies it)."""
    if args.backend == "native" and args.repo_path is not None:
        raise UsageError(
            "cona train: --repo-path names a Megatron-DeepSpeed checkout; drop it or --backend native"
        )
    mds = args.backend == "megatron-deepspeed" or args.repo_path is not None
    if not mds and (args.mds_python is not None or args.mds_shim is not None):
        raise UsageError("cona train: --mds-python and --mds-shim go with --backend megatron-deepspeed")
    return mds
