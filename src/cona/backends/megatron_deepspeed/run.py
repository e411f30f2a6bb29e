"""``cona train --backend megatron-deepspeed --repo-path PATH``: fixed and chain modes through a checkout.

Both modes run through :func:`cona.runner.schedules.sequence.run_chain` with this backend's launcher and
publisher (a
fixed strategy is a one-stage chain, written to ``<run_dir>/fixed_chain.json``): the driver owns the stage
state machine, the backend says how a stage is launched, saved and verified, so the run directory, its state
and its resume behave as the native backend's. Everything this backend cannot run is refused before the
first launch: online mode (Megatron-DeepSpeed reports no gradient-noise inputs), several nodes (not verified
yet), a tp change on a checkout whose fused QKV layout cannot be resharded, micro-batches > 1 on such a
checkout, and the config keys :func:`.commands.check_supported` names.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from cona.backends.megatron_deepspeed.commands import chain_shape, check_supported
from cona.backends.megatron_deepspeed.environment import MdsEnvironment, qkv_layout
from cona.backends.megatron_deepspeed.stage import MdsBackend
from cona.backends.megatron_deepspeed.universal import check_reshardable
from cona.errors import ChainError, ConfigError
from cona.runner.fixed import FixedRun, one_stage_chain
from cona.runner.schedules.chain import load_chain, planned_iterations
from cona.runner.schedules.chain_options import ChainRun
from cona.runner.schedules.sequence import run_chain
from cona.runner.stage_run import checkpoint_dtype
from cona.runner.state import RunState
from cona.strategy import Strategy

BACKEND_NAME = "megatron-deepspeed"


def refuse_online() -> None:
    raise ConfigError(
        f"cona train --backend {BACKEND_NAME}: online mode (--gpus without --chain) needs the gradient noise "
        "scale, which Megatron-DeepSpeed does not report; run online mode with the native backend, or give "
        "--chain FILE or a fixed strategy"
    )


def train_fixed(run: FixedRun, env: MdsEnvironment, *, node_flags: Sequence[str] = ()) -> RunState:
    """``cona train --dp .. --iters N --workdir W --repo-path PATH``: a one-stage chain in its run
    directory (resumed when it exists). ``node_flags``: the multi-node flags given, which this backend
    refuses."""
    if node_flags:
        raise ConfigError(f"{', '.join(node_flags)}: the Megatron-DeepSpeed backend runs on one node for now")
    check_supported(run.config, run.strategy, run.device_type)  # before the run directory is made
    chain = one_stage_chain(run, run.open_run_dir())
    return run_mds_chain(chain, env)


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
    if chain.start_checkpoint is not None:
        raise ChainError(
            f"{chain.path}: step 1: load_checkpoint: the Megatron-DeepSpeed backend starts a chain from "
            "scratch for now; use the native backend"
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
