"""``cona train --dp D --tp T --pp P --gbs G --mbs M --iters N --workdir W``: one fixed strategy, one stage.

The layout is checked before anything is launched; then the run directory is made (and printed on the
first line), the stage spec written, and ``dp*tp*pp`` workers started under torchrun (CPU processes with
gloo, or one per GPU with NCCL). ``--chain FILE`` runs a chain of strategies
(cona.runner.sequence); ``--gpus`` alone runs online search. Every mode also runs across nodes (--num-nodes,
--hostfile; cona.runner.across_nodes): a fixed strategy there runs as a one-stage chain.
``--backend megatron-deepspeed --repo-path PATH`` (``--repo-path`` alone implies it) runs the fixed
and chain modes through a Megatron-DeepSpeed checkout (cona.backends.megatron_deepspeed).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from cona.config import ConaConfig, load_config
from cona.engine.spec import StageResult, StageSpec
from cona.errors import ConaError, LaunchError
from cona.runner.launch import DEFAULT_MASTER_PORT_BASE, Topology, run_stage, stage_master_port
from cona.runner.run_dir import check_workdir, create_run_dir, default_run_name, resolve_log_root, stage_dir
from cona.strategy import Strategy

FIXED_STRATEGY_FLAGS = ("dp", "tp", "pp", "gbs", "mbs", "iters", "workdir")
MULTI_NODE_FLAGS = ("num_nodes", "gpus_per_node", "hostfile", "master_addr", "node_rank", "no_ssh")
BACKENDS = ("native", "megatron-deepspeed")
ONLINE_FLAGS = ("system", "initial_gbs", "max_gbs", "total_iters", "total_tokens", "target_ppl", "no_botorch")


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
        default=None,
        help="stage N rendezvous on port BASE+N (default: on one node torchrun picks a free port for every "
        f"stage; across nodes {DEFAULT_MASTER_PORT_BASE})",
    )
    parser.add_argument(
        "--quiet",
        action="store_true",
        help="only stage start/finish/switch lines and errors (no live progress)",
    )
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
    chain.add_argument("--fresh", action="store_true", help="discard the chain's run state and start it over")
    chain.add_argument(
        "--restart-workers",
        action="store_true",
        help="start new worker processes for every stage of a chain or online run (by default consecutive "
        "stages on one node reuse the processes; the switch still saves and loads the checkpoint)",
    )
    _add_online_flags(parser)
    _add_multi_node_flags(parser)
    _add_backend_flags(parser)
    parser.set_defaults(func=_train)


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
        "--system", default=None, help="system the performance model plans for (cona predict lists them)"
    )
    online.add_argument("--initial-gbs", type=int, default=None, help="global batch size of the first stage")
    online.add_argument(
        "--max-gbs", type=int, default=None, help="largest gbs a switch may reach (default: --initial-gbs)"
    )
    online.add_argument("--total-iters", type=int, default=None, help="stop after this many iterations")
    online.add_argument("--total-tokens", type=int, default=None, help="stop after this many tokens")
    online.add_argument(
        "--target-ppl", type=float, default=None, help="stop at the first evaluation with perplexity <= this"
    )
    online.add_argument(
        "--no-botorch",
        action="store_true",
        default=None,
        help="search each frontier exhaustively instead of by Bayesian optimisation",
    )


def _add_multi_node_flags(parser: argparse.ArgumentParser) -> None:
    nodes = parser.add_argument_group("multi-node (any mode; run the same command on every node)")
    nodes.add_argument("--num-nodes", type=int, default=None, help="nodes (with --gpus-per-node)")
    nodes.add_argument("--gpus-per-node", type=int, default=None, help="GPUs (or CPU workers) per node")
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

    with stop_on_signals():  # SIGTERM/SIGINT stop the workers and leave the run resumable
        return _train_run(args)


def _train_run(args: argparse.Namespace) -> int:
    mds = _megatron_deepspeed(args)
    if args.chain is not None:
        fixed = [f"--{name}" for name in FIXED_STRATEGY_FLAGS[:-1] if getattr(args, name) is not None]
        if fixed:
            raise ConaError(
                f"cona train: --chain takes the strategies from the chain file; drop {', '.join(fixed)}"
            )
        online = [f"--{name.replace('_', '-')}" for name in ONLINE_FLAGS if getattr(args, name) is not None]
        if online:
            raise ConaError(
                f"cona train: --chain takes the strategies from the chain file; drop {', '.join(online)}"
            )
        if mds:
            from cona.backends.megatron_deepspeed.run import train_chain

            train_chain(args)
            return 0
        from cona.runner.console import RunConsole
        from cona.runner.sequence import run_chain  # imports torch: not at `cona --help`
        from cona.runner.worker_session import stage_launcher

        console = RunConsole.for_stdout(quiet=args.quiet)
        with stage_launcher(restart_workers=getattr(args, "restart_workers", False)) as launcher:
            run_chain(args, launcher=console.launcher(launcher), out=console.message)
        return 0
    online_given = any(getattr(args, name) is not None for name in ONLINE_FLAGS)
    if args.gpus is not None or online_given:
        if mds:
            from cona.backends.megatron_deepspeed.run import refuse_online

            refuse_online()
        others = [f"--{name}" for name in FIXED_STRATEGY_FLAGS[:-1] if getattr(args, name) is not None]
        if others:
            raise ConaError(
                "cona train: online mode (--gpus or --num-nodes without --chain) chooses the strategies; "
                f"drop {', '.join(others)}"
            )
        from cona.runner.console import RunConsole
        from cona.runner.online import run_online  # imports torch: not at `cona --help` time
        from cona.runner.worker_session import stage_launcher

        console = RunConsole.for_stdout(quiet=args.quiet)
        with stage_launcher(restart_workers=getattr(args, "restart_workers", False)) as launcher:
            run_online(args, launcher=console.launcher(launcher), out=console.message)
        return 0
    online = [f"--{name.replace('_', '-')}" for name in ONLINE_FLAGS if getattr(args, name) is not None]
    if online:
        raise ConaError(f"cona train: {', '.join(online)} go with --gpus (online mode)")
    across_nodes = any(getattr(args, name) not in (None, False) for name in MULTI_NODE_FLAGS)
    if args.fresh and not across_nodes:  # one fixed stage always starts a new run directory
        raise ConaError("cona train: --fresh goes with --chain, online mode or a run across nodes")
    if getattr(args, "restart_workers", False):  # one stage: there is nothing to restart
        raise ConaError("cona train: --restart-workers goes with --chain or online mode")
    missing = [f"--{name}" for name in FIXED_STRATEGY_FLAGS if getattr(args, name) is None]
    if missing:
        raise ConaError(
            f"cona train: missing {', '.join(missing)} (a fixed strategy needs --dp --tp --pp "
            f"--gbs --mbs --iters --workdir)"
        )
    if args.iters <= 0:
        raise ConaError(f"cona train: --iters must be positive, got {args.iters}")
    args.workdir = check_workdir(args.workdir)
    config = load_config(args.config, check_data_files=True)
    if args.device is not None:
        config = dataclasses.replace(
            config, training=dataclasses.replace(config.training, device=args.device)
        )
    config = resolve_log_root(config)
    strategy = strategy_from_flags(args, config)
    from cona.engine.parallel_dims import validate_layout  # imports torch: not at `cona --help` time
    from cona.runner.console import RunConsole

    console = RunConsole.for_stdout(quiet=args.quiet)

    validate_layout(config.model, config.training, strategy, world_size=strategy.world_size)
    if not mds and across_nodes:
        from cona.runner.fixed_across_nodes import train_fixed_across_nodes

        train_fixed_across_nodes(args, config, strategy, console)  # each node checks its own GPUs
        return 0
    device_type = _device_type(config, strategy.world_size)
    if mds:
        from cona.backends.megatron_deepspeed.run import train_fixed

        train_fixed(args, strategy, config, device_type)
        return 0
    run_name = args.run_name or default_run_name(f"dp{strategy.dp}_tp{strategy.tp}_pp{strategy.pp}")
    run_dir = create_run_dir(Path(config.training.log_root), run_name)
    print(f"run directory: {run_dir}", flush=True)
    from cona.runner.run_tracker import wandb_notice
    from cona.runner.stage_run import checkpoint_dtype, stage_lr

    print(wandb_notice(config.training, run_name), flush=True)  # a fixed run has no decisions to track

    lr = stage_lr(run_dir, config.training, strategy.gbs, 0)
    spec = StageSpec(
        run_dir=run_dir,
        config=config,
        strategy=strategy,
        stage=1,
        workdir=args.workdir.resolve(),
        target_iteration=args.iters,
        planned_tokens=args.iters * strategy.gbs * config.model.seq,
        # the base LR is the one of training.base_gbs; at another gbs it is scaled as a chain scales it
        lr_factor=lr.lr_factor,
        min_lr_factor=lr.min_lr_factor,
    )
    spec_path = spec.write(stage_dir(run_dir, spec.stage) / "spec.json")
    topology = Topology(
        nproc_per_node=strategy.world_size, master_port=stage_master_port(args.master_port_base, spec.stage)
    )
    from cona.engine.checkpoint import layout_dir
    from cona.runner.run_lock import lock_directory, run_locks

    with run_locks(), console.stage(spec) as watch:  # one run at a time on a checkpoint folder
        lock_directory(run_dir, "run directory")
        dtype = checkpoint_dtype(config.training, device_type)
        lock_directory(layout_dir(spec.workdir, config, strategy, dtype), "checkpoint folder")
        run_stage(spec_path, spec.stage_dir, topology, device_type=device_type, quiet=True, watch=watch)
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


def _megatron_deepspeed(args: argparse.Namespace) -> bool:
    """Whether the run goes through a Megatron-DeepSpeed checkout (``--repo-path`` alone implies it)."""
    if args.backend == "native" and args.repo_path is not None:
        raise ConaError(
            "cona train: --repo-path names a Megatron-DeepSpeed checkout; drop it or --backend native"
        )
    mds = args.backend == "megatron-deepspeed" or args.repo_path is not None
    if not mds and (args.mds_python is not None or args.mds_shim is not None):
        raise ConaError("cona train: --mds-python and --mds-shim go with --backend megatron-deepspeed")
    return mds


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
