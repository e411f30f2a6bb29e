"""``cona train --dp D --tp T --pp P --gbs G --mbs M --iters N --workdir W``: one fixed strategy, one stage.

The layout is checked before anything is launched; then the run directory is made (and printed on the
first line), the stage spec written, and ``dp*tp*pp`` workers started under torchrun (CPU processes with
gloo, or one per GPU with NCCL). ``--chain FILE`` runs a chain of strategies
(cona.runner.sequence). Online search and multi-node runs are other modes that later issues add; their flags
are recognised and refused with the issue that adds them.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from cona.config import ConaConfig, load_config
from cona.engine.spec import StageResult, StageSpec
from cona.errors import ConaError, LaunchError
from cona.runner.launch import DEFAULT_MASTER_PORT_BASE, Topology, run_stage, stage_master_port
from cona.runner.run_dir import create_run_dir, default_run_name, resolve_log_root, stage_dir
from cona.strategy import Strategy

FIXED_STRATEGY_FLAGS = ("dp", "tp", "pp", "gbs", "mbs", "iters", "workdir")
# Flags of the other modes of `cona train`: (flag, takes a value, issue that adds it).
OTHER_MODE_FLAGS = (
    ("--system", True, 6), ("--initial-gbs", True, 6), ("--max-gbs", True, 6),
    ("--total-iters", True, 6), ("--total-tokens", True, 6), ("--target-ppl", True, 6),
    ("--no-botorch", False, 6),
    ("--hostfile", True, 7),
    ("--master-addr", True, 7), ("--node-rank", True, 7), ("--no-ssh", False, 7),
    ("--backend", True, 11), ("--repo-path", True, 11),
)  # fmt: skip


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "train",
        help="Train under a fixed strategy (--dp --tp --pp --gbs --mbs --iters --workdir)",
        description="Train under one fixed strategy: dp*tp*pp CPU processes or GPUs, for --iters iterations.",
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
        fixed.add_argument(f"--{name}", type=int, default=None, metavar=name[0].upper(), help=help_text)
    fixed.add_argument("--workdir", type=Path, default=None, help="checkpoints go to WORKDIR/checkpoints/...")
    parser.add_argument(
        "--config", default=None, help="config file (default: .conaconfig in cwd or a parent)"
    )
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
        type=int,
        default=DEFAULT_MASTER_PORT_BASE,
        help="stage N rendezvous on port BASE+N (default %(default)s)",
    )
    parser.add_argument("--quiet", action="store_true", help="no per-interval console lines")
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
    chain.add_argument("--num-nodes", type=int, default=None, help="nodes (with --gpus-per-node)")
    chain.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node (with --num-nodes)")
    chain.add_argument("--fresh", action="store_true", help="discard the chain's run state and start it over")
    later = parser.add_argument_group("other modes (not available yet)")
    for flag, takes_value, issue in OTHER_MODE_FLAGS:
        later.add_argument(
            flag,
            dest=_dest(flag),
            default=None,
            help=f"added by issue {issue}",
            **({"metavar": "X"} if takes_value else {"action": "store_const", "const": True}),
        )
    parser.set_defaults(func=_train)


def _dest(flag: str) -> str:
    """The argparse name of a flag (``--num-nodes`` -> ``num_nodes``), as the mode adding it reads it."""
    return flag.lstrip("-").replace("-", "_")


def _train(args: argparse.Namespace) -> int:
    _refuse_other_modes(args)
    if args.chain is not None:
        fixed = [f"--{name}" for name in FIXED_STRATEGY_FLAGS[:-1] if getattr(args, name) is not None]
        if fixed:
            raise ConaError(
                f"cona train: --chain takes the strategies from the chain file; drop {', '.join(fixed)}"
            )
        from cona.runner.sequence import run_chain  # imports torch: not at `cona --help` time

        run_chain(args)
        return 0
    if args.gpus is not None:
        raise ConaError("cona train --gpus without --chain is online mode: not available yet (issue 6)")
    if args.fresh or args.num_nodes is not None or args.gpus_per_node is not None:
        raise ConaError("cona train: --fresh, --num-nodes and --gpus-per-node go with --chain")
    missing = [f"--{name}" for name in FIXED_STRATEGY_FLAGS if getattr(args, name) is None]
    if missing:
        raise ConaError(
            f"cona train: missing {', '.join(missing)} (a fixed strategy needs --dp --tp --pp "
            f"--gbs --mbs --iters --workdir)"
        )
    if args.iters <= 0:
        raise ConaError(f"cona train: --iters must be positive, got {args.iters}")
    config = load_config(args.config, check_data_files=True)
    if args.device is not None:
        config = dataclasses.replace(
            config, training=dataclasses.replace(config.training, device=args.device)
        )
    config = resolve_log_root(config)
    strategy = strategy_from_flags(args, config)
    from cona.engine.parallel_dims import validate_layout  # imports torch: not at `cona --help` time

    validate_layout(config.model, config.training, strategy, world_size=strategy.world_size)
    device_type = _device_type(config, strategy.world_size)

    run_name = args.run_name or default_run_name(f"dp{strategy.dp}_tp{strategy.tp}_pp{strategy.pp}")
    run_dir = create_run_dir(Path(config.training.log_root), run_name)
    print(f"run directory: {run_dir}", flush=True)
    spec = StageSpec(
        run_dir=run_dir,
        config=config,
        strategy=strategy,
        stage=1,
        workdir=args.workdir.resolve(),
        target_iteration=args.iters,
        planned_tokens=args.iters * strategy.gbs * config.model.seq,
    )
    spec_path = spec.write(stage_dir(run_dir, spec.stage) / "spec.json")
    topology = Topology(
        nproc_per_node=strategy.world_size, master_port=stage_master_port(args.master_port_base, spec.stage)
    )
    run_stage(spec_path, spec.stage_dir, topology, device_type=device_type, quiet=args.quiet)
    result = StageResult.read(spec.result_path)
    print(
        f"stage {result.stage} {result.reason} at iteration {result.last_iteration} "
        f"({result.consumed_tokens:,} tokens); checkpoint: {result.checkpoint}; metrics: {spec.metrics_path}"
    )
    return 0


def strategy_from_flags(args: argparse.Namespace, config: ConaConfig) -> Strategy:
    """The flags' degrees and batch sizes; how to run them (zero stage, schedule, ...) from the config."""
    training = config.training
    return Strategy(
        dp=args.dp,
        tp=args.tp,
        pp=args.pp,
        mbs=args.mbs,
        gbs=args.gbs,
        zero_stage=training.zero_stage,
        recompute=training.recompute,
        sequence_parallel=training.sequence_parallel,
        pipeline_schedule=training.pipeline_schedule,
        virtual_stages=training.pipeline_virtual_stages,
    )


def _refuse_other_modes(args: argparse.Namespace) -> None:
    for flag, _, issue in OTHER_MODE_FLAGS:
        if getattr(args, _dest(flag)) is not None:
            raise ConaError(f"cona train {flag}: not available yet (issue {issue})")


def _device_type(config: ConaConfig, world_size: int) -> str:
    """``cpu`` or ``cuda`` as the workers will resolve it; a CUDA run needs a GPU per process."""
    import torch  # here, not at import: `cona --help` should not pay for it

    requested = config.training.device
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return "cpu"
    available = torch.cuda.device_count()
    if available < world_size:
        raise LaunchError(
            f"dp*tp*pp = {world_size} processes need {world_size} GPUs, but {available} are visible "
            f"(training.device={requested}; --device cpu runs them as CPU processes)"
        )
    return "cuda"
