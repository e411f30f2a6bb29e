"""Run a chain (``cona train --chain FILE``): one stage after another, with hand-off, publish, prune, resume.

For each step of the chain the runner fixes the stage's plan at its first launch (start iteration, stop
iteration, checkpoint to load, LR factors) and records it in the run state, writes the stage spec, launches
the workers, reads ``stage_result.json``, publishes the checkpoint as universal when the step converts,
applies the step's pruning entries, and logs what the switch into the stage cost. Every transition is saved
in ``runner_state.json`` (see :mod:`cona.runner.state`), so rerunning the same command after a kill
continues where the run stood.

Across nodes (``--num-nodes``) every node runs the same command: node 0 drives the chain as above, announcing
each stage to the other nodes' runners and publishing only once all of them left it
(:mod:`cona.runner.multinode_sync`); the others run their part of each stage it announces.

The load path of a stage is ``latest_universal`` of the previous stage's layout when that stage converts
(checked to name the copy this run published), else the previous stage's own ``global_step`` directory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cona.engine.checkpoint import resolve_checkpoint
from cona.engine.spec import StageResult, StageSpec
from cona.errors import ChainError, LaunchError
from cona.runner.across_nodes import run_across_nodes
from cona.runner.chain import (
    ChainConfig,
    ChainStep,
    content_digest,
    layout_relpath,
    load_chain,
    planned_tokens,
)
from cona.runner.chain_options import ChainRun, stage_topology
from cona.runner.launch import stage_master_port
from cona.runner.multinode import runner_command
from cona.runner.publish import LATEST_UNIVERSAL, prune, publish
from cona.runner.run_dir import point_latest
from cona.runner.run_lock import lock_directory, run_locks
from cona.runner.stage_run import (
    Launcher,
    StageLaunch,
    checkpoint_dtype,
    launch_stage,
    publish_timed,
    stage_lr,
    switch_check_line,
    torchrun_launcher,
    write_plan,
)
from cona.runner.state import (
    RunState,
    StageState,
    advance,
    finished_result,
    open_run,
    own_checkpoint,
    save_state,
    switch_cost,
    trained,
)

Publisher = Callable[[Path], Path]
"""Makes a stage's ``global_step<N>`` checkpoint loadable under another layout: returns the universal
directory it published (with the ``latest_universal`` marker beside it)."""


@dataclass(frozen=True, kw_only=True)
class _Context:
    run: ChainRun
    chain: ChainConfig
    dtype: str
    launcher: Launcher
    out: Callable[[str], None]
    publisher: Publisher = publish

    def layout_dir(self, step: ChainStep) -> Path:
        return self.run.workdir / layout_relpath(self.run.config, step, self.dtype)

    def save(self, state: RunState, stage: StageState) -> RunState:
        state = state.with_stage(stage)
        save_state(self.run.run_dir, state)
        return state


def run_chain(
    run: ChainRun,
    *,
    launcher: Launcher = torchrun_launcher,
    out: Callable[[str], None] = print,
    publisher: Publisher = publish,
) -> RunState:
    """Run (or resume) a chain to its end; returns the final run state. ``launcher`` and ``publisher`` are
    the backend's (the native engine's by default; :mod:`cona.backends.megatron_deepspeed` has its own)."""
    with run_locks():  # whatever the run locked is free again when it ends
        if run.nodes.num_nodes > 1:
            return _run_on_nodes(run, launcher, out, publisher)
        return _drive_chain(run, launcher, out, publisher)


def _drive_chain(
    run: ChainRun, launcher: Launcher, out: Callable[[str], None], publisher: Publisher = publish
) -> RunState:
    dtype = checkpoint_dtype(run.config.training, run.device_type)
    chain = load_chain(
        run.chain_path, config=run.config, world_size=run.world_size, dtype=dtype, workdir=run.workdir
    )
    ctx = _Context(run=run, chain=chain, dtype=dtype, launcher=launcher, out=out, publisher=publisher)
    lock_directory(run.run_dir, "run directory")  # before the run state is read: one runner at a time
    for step in chain.steps:
        lock_directory(ctx.layout_dir(step), "checkpoint folder")
    state = _open_run(ctx)
    if state.current is None:
        return state
    for step in chain.steps:
        state = _run_step(ctx, state, step)
    last = state.stages[-1]
    out(
        f"run {run.run_dir.name} finished: {len(chain.steps)} stages, iteration {last.last_iteration}, "
        f"consumed_samples={last.consumed_samples}, consumed_tokens={last.consumed_tokens}"
    )
    return state


def _run_on_nodes(
    run: ChainRun, launcher: Launcher, out: Callable[[str], None], publisher: Publisher = publish
) -> RunState:
    """Node 0 drives the chain and announces every stage; the other nodes follow its announcements."""
    dtype = checkpoint_dtype(run.config.training, run.device_type)  # every node validates the chain
    load_chain(run.chain_path, config=run.config, world_size=run.world_size, dtype=dtype, workdir=run.workdir)
    return run_across_nodes(
        run_dir=run.run_dir,
        nodes=run.nodes,
        timeout_s=run.config.training.distributed_timeout_minutes * 60.0,
        world_size=run.world_size,
        device_type=run.device_type,
        quiet=run.quiet,
        launcher=launcher,
        out=out,
        remote_command=runner_command(run),
        drive=lambda coordinated: _drive_chain(run, coordinated, out, publisher),
    )


def _open_run(ctx: _Context) -> RunState:
    """Load or start the run's state and say which on the first line."""
    run = ctx.run
    state, first_line = open_run(
        run.run_dir,
        chain=ctx.chain,
        config_digest=content_digest(run.config.to_dict()),
        world_size=run.world_size,
        fresh=run.fresh,
        layout_dirs=[ctx.layout_dir(step) for step in ctx.chain.steps],
    )
    ctx.out(first_line)
    point_latest(run.run_dir)
    return state


def _run_step(ctx: _Context, state: RunState, step: ChainStep) -> RunState:
    """Drive one stage from wherever its status stands to done; every move is saved before the next."""
    if state.stage(step.step_num).status in ("pending", "running"):
        state = _train(ctx, state, step)
    stage = state.stage(step.step_num)
    if stage.status == "trained":
        stage = advance(stage, "published", **_publish_changes(ctx, stage, step))
        state = ctx.save(state, stage)
    if stage.status == "published":
        stage = advance(stage, "pruned", pruned=_apply_pruning(ctx, step))
        state = ctx.save(state, stage)
    if stage.status == "pruned":
        cost = switch_cost(state.stage(step.step_num - 1), stage) if step.step_num > 1 else {}
        if cost:
            parts = ", ".join(
                f"{key.removesuffix('_s').replace('_', ' ')} {value:.2f} s" for key, value in cost.items()
            )
            ctx.out(f"switch {step.step_num - 1}->{step.step_num}: {parts}; total {sum(cost.values()):.2f} s")
        state = ctx.save(state, advance(stage, "done", switch_cost=cost))
    return state


def _train(ctx: _Context, state: RunState, step: ChainStep) -> RunState:
    stage = state.stage(step.step_num)
    if stage.status == "pending":
        stage = _plan_stage(ctx, state, step)
        state = ctx.save(state, stage)
    spec = _stage_spec(ctx, stage, step)
    result, launched = finished_result(stage, spec.result_path), None
    if result is None:
        state, launched = _launch(ctx, state, spec, step)
        result = StageResult.read(spec.result_path)
    if result.reason != "completed" or result.last_iteration != stage.target_iteration:
        raise LaunchError(
            f"stage {step.step_num} stopped at iteration {result.last_iteration} ({result.reason}) "
            f"instead of its target {stage.target_iteration}"
        )
    if result.checkpoint is None:
        raise LaunchError(f"stage {step.step_num} saved no checkpoint at its end ({spec.result_path})")
    stage = trained(state.stage(step.step_num), result, launched)
    line = switch_check_line(stage)
    if line is not None:
        ctx.out(line)
    return ctx.save(state, stage)


def _launch(ctx: _Context, state: RunState, spec: StageSpec, step: ChainStep) -> tuple[RunState, float]:
    """Start one attempt of the stage and wait for it; returns the state (attempt counted) and launch time."""
    spec_path = spec.write(spec.stage_dir / "spec.json")
    spec.result_path.unlink(missing_ok=True)
    spec.switch_request_path.unlink(missing_ok=True)  # a chain's stages end by their stop rule only
    stage = state.stage(step.step_num)
    state = ctx.save(state, dataclasses.replace(stage, attempts=stage.attempts + 1))
    topology = stage_topology(ctx.run, stage_master_port(ctx.run.base_port, step.step_num))
    launch = StageLaunch(
        spec=spec,
        spec_path=spec_path,
        topology=topology,
        device_type=ctx.run.device_type,
        quiet=ctx.run.quiet,
    )
    return state, launch_stage(ctx.launcher, launch)


def _plan_stage(ctx: _Context, state: RunState, step: ChainStep) -> StageState:
    """Fix the stage's start, stop, load path and LR factors (kept for every relaunch)."""
    training = ctx.run.config.training
    load_path = None if step.is_initial else _planned_load(ctx, state, step)
    start = 0 if step.is_initial else state.stage(step.step_num - 1).last_iteration
    target = step.target_iteration(start)
    if target <= start:
        raise ChainError(
            f"{ctx.chain.path}: step {step.step_num}: stops at iteration {target}, but its "
            f"checkpoint is already at iteration {start}"
        )
    lr = stage_lr(ctx.run.run_dir, training, step.gbs, start)
    plan = {
        "start_iteration": start,
        "target_iteration": target,
        "load_path": str(load_path) if load_path else None,
        "lr": lr.scaled.lr,
        "min_lr": lr.scaled.min_lr,
        "lr_factor": lr.lr_factor,
        "min_lr_factor": lr.min_lr_factor,
    }
    ctx.out(
        f"stage {step.step_num}: dp{step.dp}/tp{step.tp}/pp{step.pp} mbs{step.mbs} gbs{step.gbs}, "
        f"iterations {start}->{target}, lr {lr.scaled.lr:.3g} (x{lr.lr_factor:.3g})"
        f"{', capped' if lr.scaled.capped else ''}, load {load_path or 'none (from scratch)'}"
    )
    return advance(
        state.stage(step.step_num),
        "running",
        start_iteration=start,
        target_iteration=target,
        load_path=plan["load_path"],
        planned_at=write_plan(ctx.run.run_dir, step.step_num, plan),
        lr_factor=lr.lr_factor,
        min_lr_factor=lr.min_lr_factor,
    )


def _planned_load(ctx: _Context, state: RunState, step: ChainStep) -> Path:
    """What a non-initial stage loads: the previous stage's published universal copy (through
    ``latest_universal``) when it converts, else its own global_step directory."""
    previous = state.stage(step.step_num - 1)
    previous_step = ctx.chain.steps[step.step_num - 2]
    if not previous_step.convert:
        return Path(previous.checkpoint)
    marker = ctx.layout_dir(previous_step) / LATEST_UNIVERSAL
    universal = resolve_checkpoint(marker)
    if universal.resolve() != Path(previous.universal).resolve():
        raise ChainError(
            f"{marker} names {universal.name}, not {Path(previous.universal).name} that step "
            f"{previous.step_num} published; does another run share --workdir {ctx.run.workdir}?"
        )
    return universal


def _stage_spec(ctx: _Context, stage: StageState, step: ChainStep) -> StageSpec:
    """The spec of the next attempt: from the stage's own newest checkpoint if an attempt saved one."""
    own = own_checkpoint(stage, ctx.layout_dir(step))
    load_path = own if own is not None else (Path(stage.load_path) if stage.load_path else None)
    return StageSpec(
        run_dir=ctx.run.run_dir,
        config=ctx.run.config,
        strategy=step.strategy(ctx.run.config),
        stage=step.step_num,
        workdir=ctx.run.workdir,
        planned_tokens=planned_tokens(ctx.chain, ctx.run.config.model.seq),
        load_path=load_path,
        target_iteration=stage.target_iteration,
        lr_factor=stage.lr_factor,
        min_lr_factor=stage.min_lr_factor,
        save_at_end=True,
    )


def _publish_changes(ctx: _Context, stage: StageState, step: ChainStep) -> dict:
    return publish_timed(ctx.publisher, stage, ctx.out) if step.convert else {}


def _apply_pruning(ctx: _Context, step: ChainStep) -> tuple[str, ...]:
    removed: list[str] = []
    for rule in ctx.chain.rules_after(step.step_num):
        result = prune(rule, ctx.run.workdir)
        ctx.out(
            f"stage {step.step_num}: pruned {result.layout_dir} ({rule.mode}): removed "
            f"{', '.join(result.removed) or 'nothing'}"
        )
        removed.extend(str(result.layout_dir / name) for name in result.removed)
    return tuple(removed)
