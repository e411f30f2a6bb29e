"""``cona train --backend megatron-deepspeed --repo-path PATH``: fixed, chain and online modes via a checkout.

Fixed and chain modes run through :func:`cona.runner.schedules.chain_schedule.run_chain`, online mode through
:func:`cona.runner.schedules.online.run_online`, with this backend's launcher and publisher (a fixed strategy
is a one-stage chain, built in memory): the driver owns the stage state machine, the backend says how a stage
is launched, saved and verified, so the run directory, its state and its resume behave as the native
backend's. Online mode gets its gradient-noise inputs from CONA's hooks in the launched processes
(``launched/``), and its stages stop at the search's switch request through the same hooks. Across nodes every
node's runner starts its share of each stage with ``deepspeed --no_ssh`` (:mod:`.nodes`). Everything this
backend cannot run is refused before the first launch: node 0 starting the other nodes over ssh, a tp change
on a checkout whose fused QKV layout cannot be resharded, micro-batches > 1 on such a checkout (online mode:
such a checkout at all, since the policy may choose either), and the config keys
:func:`.commands.check_supported` names.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence

from cona.backends.megatron_deepspeed.commands import chain_shape, check_supported, online_shape
from cona.backends.megatron_deepspeed.environment import MdsEnvironment, qkv_layout
from cona.backends.megatron_deepspeed.stage import MdsBackend
from cona.backends.megatron_deepspeed.universal import check_reshardable
from cona.errors import ChainError, ConfigError
from cona.runner.chain_file import planned_iterations
from cona.runner.fixed import one_stage_chain, open_run_dir
from cona.runner.nodes.multinode import NodePlacement
from cona.runner.run_descriptions import ChainRun, FixedRun, OnlineRun
from cona.runner.schedules.chain_schedule import run_chain
from cona.runner.schedules.online import run_online
from cona.runner.stage_run import checkpoint_dtype
from cona.runner.state import RunState
from cona.strategy import Strategy

BACKEND_NAME = "megatron-deepspeed"


def run_mds_online(
    run: OnlineRun, env: MdsEnvironment, *, out: Callable[[str], None] = print, in_place: bool = True
) -> RunState:
    """``cona train --gpus N --repo-path PATH ...``: the online policy decides the stages, this backend runs
    them. A switch that changes only the gbs is done in place on one node (``in_place``; off with
    ``--restart-workers``), every other one through a checkpoint."""
    check_nodes(run.nodes)
    config = run.config
    zero_stage = config.training.runtime.zero_stage
    check_supported(config, Strategy(dp=run.world_size, tp=1, pp=1, mbs=1, gbs=run.initial_gbs,
                                     zero_stage=zero_stage), run.device_type)  # fmt: skip
    if qkv_layout(env.repo) == "blocked":
        raise ChainError(
            f"--repo-path {env.repo}: online mode may change tp and mbs, which this checkout (commit "
            "676a482c or later: blocked fused-QKV layout) cannot do; use an older checkout, or a chain"
        )
    backend = MdsBackend(
        env=env,
        shape=online_shape(config, world_size=run.world_size, max_samples=online_max_samples(run)),
        device_type=run.device_type,
        base_env=dict(os.environ),
        switch_requests=True,
        in_place=in_place and run.nodes.num_nodes == 1,
        out=out,
    )
    try:
        return run_online(run, launcher=backend, publisher=backend.publish, prepare_publisher=None, out=out)
    finally:
        backend.close()


def online_max_samples(run: OnlineRun) -> int:
    """A bound on the samples and, times the largest gbs, on the iterations of an online run: its
    ``--train-samples``, constant over the run (see :func:`.commands.online_shape`). The gbs never falls
    below ``--initial-gbs``, so a token budget is reached within ``budget samples / initial gbs``
    iterations."""
    seq = run.config.model.seq
    total_tokens = (
        run.total_tokens if run.total_tokens is not None else run.config.training.lr.lr_decay_tokens
    )
    bounds = [] if run.total_iters is None else [run.total_iters]
    if total_tokens is not None:
        bounds.append(math.ceil(math.ceil(total_tokens / seq) / run.initial_gbs))
    if not bounds:
        raise ConfigError("online mode: give --total-iters or --total-tokens (or training.lr_decay_tokens)")
    return min(bounds) * run.max_gbs


def train_fixed(run: FixedRun, env: MdsEnvironment) -> RunState:
    """``cona train --dp .. --iters N --workdir W --repo-path PATH`` on one node: a one-stage chain in its
    run directory, resumed when it exists (across nodes the CLI runs the same chain as a chain run, as for
    the native backend)."""
    check_supported(run.config, run.strategy, run.device_type)  # before the run directory is made
    chain = one_stage_chain(run, open_run_dir(run))
    return run_mds_chain(chain, env)


def run_mds_chain(
    run: ChainRun,
    env: MdsEnvironment,
    *,
    out: Callable[[str], None] = print,
    repair: bool = True,
    verify: bool = True,
    check_qkv: bool = True,
    keep_workers: bool = True,
) -> RunState:
    """Validate the chain for this checkout, then run it. ``repair``/``check_qkv`` off only in the tests that
    show what verification catches without them. With ``--switch-in-place`` a step that changes only the
    gbs continues the previous step's processes (one node; ``keep_workers`` off: ``--restart-workers``)."""
    check_nodes(run.nodes)
    dtype = checkpoint_dtype(run.config.training, run.device_type)
    chain = run.read_chain(dtype)
    if chain.start_checkpoint is not None:
        raise ChainError(
            f"{chain.origin}: step 1: load_checkpoint: the Megatron-DeepSpeed backend starts a chain from "
            "scratch for now; use the native backend"
        )
    strategies = [step.strategy(run.config) for step in chain.steps]
    stops = [end for _, end in planned_iterations(chain)]
    for strategy in strategies:
        check_supported(run.config, strategy, run.device_type)
    if check_qkv:
        check_checkout(env, strategies, where=chain.origin)
    backend = MdsBackend(
        env=env,
        shape=chain_shape(run.config, zip(strategies, stops, strict=True)),
        device_type=run.device_type,
        base_env=dict(os.environ),
        repair=repair,
        verify=verify,
        in_place=keep_workers and run.nodes.num_nodes == 1,
        out=out,
    )
    try:
        return run_chain(run, launcher=backend, publisher=backend.publish, prepare_publisher=None, out=out)
    finally:
        backend.close()


def check_nodes(nodes: NodePlacement) -> None:
    """Across nodes every node's runner must be started with this backend's flags: by hand (``--no-ssh
    --node-rank R``) or by Slurm. Node 0's ssh start would start them without (it passes the mode's flags
    only), so it is refused."""
    if nodes.num_nodes > 1 and nodes.ssh:
        raise ChainError(
            f"--num-nodes {nodes.num_nodes}: with the Megatron-DeepSpeed backend start every node's runner "
            "yourself (--no-ssh --node-rank R, the same --repo-path/--mds-python on each) or under Slurm; "
            "node 0 does not start them over ssh for this backend yet"
        )


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
