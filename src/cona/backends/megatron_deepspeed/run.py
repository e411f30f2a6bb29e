"""``cona train --backend megatron-deepspeed --repo-path PATH``: fixed and chain modes through a checkout.

Both modes run through :func:`cona.runner.sequence.run_chain` with this backend's launcher and publisher (a
fixed
strategy is a one-stage chain, written to ``<run_dir>/fixed_chain.json``), so the run directory, its state
and its
resume behave as the native backend's. Everything this backend cannot run is refused before the first launch:
online mode (Megatron-DeepSpeed reports no gradient-noise inputs), several nodes (not verified yet), a tp
change on
a checkout whose fused QKV layout cannot be resharded, micro-batches > 1 on such a checkout, and the config
keys
:func:`.commands.check_supported` names.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from cona.backends.megatron_deepspeed.commands import chain_shape, check_supported
from cona.backends.megatron_deepspeed.environment import MdsEnvironment, qkv_layout, resolve_environment
from cona.backends.megatron_deepspeed.stage import MdsBackend
from cona.backends.megatron_deepspeed.universal import check_reshardable
from cona.config import ConaConfig
from cona.errors import ChainError, ConfigError
from cona.runner.chain import load_chain, planned_iterations
from cona.runner.chain_options import ChainRun, chain_run_from_args
from cona.runner.run_dir import create_run_dir, default_run_name
from cona.runner.sequence import run_chain
from cona.runner.stage_run import checkpoint_dtype
from cona.runner.state import RunState
from cona.strategy import Strategy

BACKEND_NAME = "megatron-deepspeed"
FIXED_CHAIN_NAME = "fixed_chain.json"
NODE_FLAGS = ("num_nodes", "gpus_per_node", "hostfile", "master_addr", "node_rank", "no_ssh")


def environment_from_args(args: argparse.Namespace) -> MdsEnvironment:
    return resolve_environment(
        getattr(args, "repo_path", None),
        getattr(args, "mds_python", None),
        getattr(args, "mds_shim", None),
        os.environ,
    )


def refuse_online() -> None:
    raise ConfigError(
        f"cona train --backend {BACKEND_NAME}: online mode (--gpus without --chain) needs the gradient noise "
        "scale, which Megatron-DeepSpeed does not report; run online mode with the native backend, or give "
        "--chain FILE or a fixed strategy"
    )


def train_chain(args: argparse.Namespace, *, out: Callable[[str], None] = print) -> RunState:
    """``cona train --chain FILE --repo-path PATH ...``."""
    env = environment_from_args(args)
    run = chain_run_from_args(args)
    return run_mds_chain(run, env, out=out)


def train_fixed(
    args: argparse.Namespace, strategy: Strategy, config: ConaConfig, device_type: str
) -> RunState:
    """``cona train --dp .. --iters N --workdir W --repo-path PATH``: a one-stage chain in a new run
    directory."""
    env = environment_from_args(args)
    across_nodes = [f"--{name.replace('_', '-')}" for name in NODE_FLAGS if getattr(args, name, None)]
    if across_nodes:
        raise ConfigError(
            f"{', '.join(across_nodes)}: the Megatron-DeepSpeed backend runs on one node for now"
        )
    check_supported(config, strategy, device_type)  # before the run directory is made
    run_name = args.run_name or default_run_name(f"dp{strategy.dp}_tp{strategy.tp}_pp{strategy.pp}")
    run_dir = create_run_dir(Path(config.training.log_root), run_name)
    print(f"run directory: {run_dir}", flush=True)
    chain_path = run_dir / FIXED_CHAIN_NAME
    step = {"step_num": 1, "dp": strategy.dp, "tp": strategy.tp, "pp": strategy.pp, "gbs": strategy.gbs}
    step.update({"mbs": strategy.mbs, "train_iters": args.iters, "is_initial": True})
    chain_path.write_text(json.dumps({"steps": [step]}, indent=1) + "\n")
    run = ChainRun(
        chain_path=chain_path,
        config=config,
        workdir=Path(args.workdir).resolve(),
        run_dir=run_dir,
        world_size=strategy.world_size,
        device_type=device_type,
        base_port=args.master_port_base,
        quiet=bool(args.quiet),
    )
    return run_mds_chain(run, env)


def run_mds_chain(
    run: ChainRun,
    env: MdsEnvironment,
    *,
    out: Callable[[str], None] = print,
    repair: bool = True,
    verify: bool = True,
    check_qkv: bool = True,
) -> RunState:
    """Validate the chain for this checkout, then run it. ``repair``/``check_qkv`` off only in the tests that
    show what verification catches without them."""
    if run.nodes.num_nodes > 1:
        raise ChainError(
            f"--num-nodes {run.nodes.num_nodes}: the Megatron-DeepSpeed backend runs on one node for now "
            "(its launcher commands for several nodes are generated but not verified); use the native backend"
        )
    dtype = checkpoint_dtype(run.config.training, run.device_type)
    chain = load_chain(
        run.chain_path, config=run.config, world_size=run.world_size, dtype=dtype, workdir=run.workdir
    )
    strategies = [step.strategy(run.config) for step in chain.steps]
    stops = [end for _, end in planned_iterations(chain)]
    for strategy in strategies:
        check_supported(run.config, strategy, run.device_type)
    if check_qkv:
        check_checkout(env, strategies, where=str(chain.path))
    backend = MdsBackend(
        env=env,
        shape=chain_shape(run.config, zip(strategies, stops, strict=True)),
        device_type=run.device_type,
        base_env=dict(os.environ),
        repair=repair,
        verify=verify,
        out=out,
    )
    return run_chain(run, launcher=backend.launch, publisher=backend.publish, out=out)


def check_checkout(env: MdsEnvironment, strategies: Sequence[Strategy], *, where: str) -> None:
    """What the checkout's fused-QKV layout forbids: a tp change (defect B) and, since the same commit,
    micro-batches > 1 (its attention views non-contiguous Q/K/V slices and raises)."""
    check_reshardable(env, [strategy.tp for strategy in strategies], where=where)
    if qkv_layout(env.repo) == "blocked":
        larger = [strategy.mbs for strategy in strategies if strategy.mbs > 1]
        if larger:
            raise ChainError(
                f"{where}: mbs={larger[0]}: the Megatron-DeepSpeed checkout {env.repo} (commit 676a482c "
                "or later) fails in its attention with micro-batches > 1 unless flash attention is used; "
                "use mbs 1"
            )
