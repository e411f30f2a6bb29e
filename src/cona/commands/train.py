"""``cona train``: one fixed strategy (``--dp D --tp T --pp P --gbs G --mbs M --iters N [--workdir W]``), a
chain (``--chain FILE``) or online search (``--gpus N`` alone).

This module only parses the flags: :func:`cona.commands.train_modes.run_training` runs the mode they ask for,
as ``cona.train`` (:mod:`cona.api`) does from its arguments.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from cona.commands.config_flags import add_config_flags
from cona.commands.flag_types import finite_float, port_base, positive_int
from cona.commands.search_flags import add_search_flags
from cona.runner.launch import DEFAULT_MASTER_PORT_BASE

BACKENDS = ("native", "megatron-deepspeed")


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
        help="run directory name under training.log_root (default: fixed-<strategy>-iters<N>, "
        "chain-<chain file> or online; the same command then resumes its run)",
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
    from cona.commands.train_modes import run_training

    run_training(args)
    return 0
