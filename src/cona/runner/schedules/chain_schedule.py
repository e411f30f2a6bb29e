"""Run a chain (``cona train --chain FILE``): the stages of a chain file, through the one stage driver.

The driver (:mod:`cona.runner.driver`) moves every stage through its states and saves each move, so
rerunning the same command after a kill continues where the run stood; this schedule says what a chain's
stages are: the step's strategy, its stop iteration (``train_iters`` or ``extra_iters``), the checkpoint it
loads, whether its checkpoint is published (``convert``) and what its pruning entries remove, and it logs
what each switch cost.

The load path of a stage is ``latest_universal`` of the previous stage's layout when that stage converts
(checked to name the copy this run published), else the previous stage's own ``global_step`` directory.
With ``--switch-in-place`` (and a launcher that keeps its workers) a step that keeps the previous step's
layout continues that step's state in the workers' memory instead: the previous step saves nothing.

Across nodes (``--num-nodes``) every node runs the same command: node 0 drives the chain as above, announcing
each stage to the other nodes' runners and publishing only once all of them left it
(:mod:`cona.runner.nodes.multinode_sync`); the others run their part of each stage it announces.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

from cona.engine.checkpoint.info import resolve_checkpoint
from cona.engine.checkpoint.paths import layout_dir, resume_folders
from cona.engine.spec import StageResult, StageSpec
from cona.errors import ChainError, LaunchError, UsageError
from cona.runner.chain_file import (
    ChainConfig,
    ChainStep,
    content_digest,
    planned_tokens,
)
from cona.runner.driver import Plan, Publisher, drive, in_place_mbs, keeps_workers, start_text
from cona.runner.publish import LATEST_UNIVERSAL, import_checkpoint_reader_in_background, prune, publish
from cona.runner.run_descriptions import ChainRun, runner_command
from cona.runner.run_dir import point_latest
from cona.runner.run_lock import lock_directory
from cona.runner.schedules.chain_edit import continue_edited
from cona.runner.stage_run import Launcher, StageLaunch, StageLR, checkpoint_dtype, torchrun_launcher
from cona.runner.state import RunState, StageState, finished_result, load_state, open_run
from cona.runner.views.run_tracker import RunTracker
from cona.strategy import Strategy

__all__ = ["ChainRun", "ChainSchedule", "Launcher", "StageLaunch", "run_chain", "torchrun_launcher"]


def run_chain(
    run: ChainRun,
    *,
    launcher: Launcher = torchrun_launcher,
    out: Callable[[str], None] = print,
    publisher: Publisher = publish,
    prepare_publisher: Callable[[], object] | None = import_checkpoint_reader_in_background,
) -> RunState:
    """Run (or resume) a chain to its end; returns the final run state. ``launcher``, ``publisher`` and
    ``prepare_publisher`` are the backend's (the native engine's by default;
    :mod:`cona.backends.megatron_deepspeed` has its own)."""
    dtype = checkpoint_dtype(run.config.training, run.device_type)
    chain = run.read_chain(dtype)  # every node validates the chain
    return drive(
        run,
        lambda stage_launcher: ChainSchedule(
            run,
            chain,
            out=out,
            in_place=_in_place(run, stage_launcher),
            in_place_mbs=in_place_mbs(stage_launcher),
        ),
        launcher=launcher,
        out=out,
        publisher=publisher,
        prepare_publisher=prepare_publisher,
        remote_command=runner_command(run) if run.nodes.num_nodes > 1 else (),
    )


def _in_place(run: ChainRun, launcher: Launcher) -> bool:
    """``--switch-in-place``, refused where the stages do not share their worker processes."""
    if run.switch_in_place and not keeps_workers(launcher):
        raise UsageError(
            "--switch-in-place needs the worker processes kept from one stage to the next: one node and no "
            "--restart-workers"
        )
    return run.switch_in_place


class ChainSchedule:
    """The stages of a chain file (see :class:`cona.runner.driver.Schedule`)."""

    reports_switch_cost = True
    max_tokens = None

    def __init__(
        self,
        run: ChainRun,
        chain: ChainConfig,
        *,
        out: Callable[[str], None],
        in_place: bool,
        in_place_mbs: bool = True,
    ) -> None:
        self.run, self.chain, self.out = run, chain, out
        self.in_place = in_place
        """Steps that keep the previous step's layout continue its state in memory."""
        self.in_place_mbs = in_place_mbs
        """... also when they change mbs (else only a gbs change is in place: the backend's launcher says)."""
        self.dtype = checkpoint_dtype(run.config.training, run.device_type)
        self.planned_tokens = planned_tokens(chain, run.config.model.seq)
        self.first_iteration = chain.start_iteration
        self.may_publish = any(step.convert for step in chain.steps)
        self.finished_before = False
        self.run_tracker = RunTracker.off()

    def step(self, step_num: int) -> ChainStep:
        return self.chain.steps[step_num - 1]

    def strategy(self, step_num: int) -> Strategy:
        return self.step(step_num).strategy(self.run.config)

    def layout_dir(self, step: ChainStep) -> Path:
        """The run's own checkpoint folder of the step's layout."""
        run = self.run
        return layout_dir(
            run.workdir, run.config, step.strategy(run.config), self.dtype, run_name=run.run_dir.name
        )

    def open(self) -> RunState:
        """Load or start the run's state and say which on the first line."""
        run = self.run
        for step in self.chain.steps:
            lock_directory(self.layout_dir(step), "checkpoint folder")
        earlier = None if run.fresh else load_state(run.run_dir)
        edit = continue_edited(earlier, self.chain, run.run_dir)[1] if earlier is not None else None
        state, first_line = open_run(
            run.run_dir,
            chain=self.chain,
            config_digest=content_digest(run.config.identity_dict()),
            world_size=run.world_size,
            fresh=run.fresh,
            resume_folders=[
                resume_folders(
                    run.workdir, run.config, step.strategy(run.config), self.dtype, run_name=run.run_dir.name
                )
                for step in self.chain.steps
            ],
            workdir=run.workdir,
        )
        self.out(first_line if edit is None else f"{first_line}; {edit}")
        point_latest(run.run_dir)
        self.finished_before = state.current is None
        return state

    def plan(self, state: RunState, stage: StageState, *, start: int, lr: StageLR, in_place: bool) -> Plan:
        step = self.step(stage.step_num)
        target = step.target_iteration(start)
        if target <= start:
            raise ChainError(
                f"{self.chain.origin}: step {step.step_num}: stops at iteration {target}, but its "
                f"checkpoint is already at iteration {start}"
            )
        if in_place or step.is_initial:
            load_path = None if in_place else self.chain.start_checkpoint  # scratch, or the given one
        else:
            load_path = self._planned_load(state, step)
        record = {
            "start_iteration": start,
            "target_iteration": target,
            "load_path": str(load_path) if load_path else None,
            "lr": lr.scaled.lr,
            "min_lr": lr.scaled.min_lr,
            "lr_factor": lr.lr_factor,
            "min_lr_factor": lr.min_lr_factor,
        }
        line = (
            f"stage {step.step_num}: dp{step.dp}/tp{step.tp}/pp{step.pp} mbs{step.mbs} gbs{step.gbs}, "
            f"iterations {start}->{target}, lr {lr.scaled.lr:.3g} (x{lr.lr_factor:.3g})"
            f"{', capped' if lr.scaled.capped else ''}, {start_text(record['load_path'], in_place)}"
        )
        if step.step_num > 1:  # planned once: one event per switch, also across a resume
            self.run_tracker.switch(
                stage=step.step_num, iteration=start, action="chain step",
                strategy=self.strategy(step.step_num).short(), reason=f"step {step.step_num} of the chain",
            )  # fmt: skip
        return Plan(target_iteration=target, load_path=record["load_path"], record=record, line=line)

    def _planned_load(self, state: RunState, step: ChainStep) -> Path:
        """What a non-initial stage loads: the previous stage's published universal copy (through
        ``latest_universal``) when it converts, else its own global_step directory."""
        previous = state.stage(step.step_num - 1)
        previous_step = self.step(step.step_num - 1)
        if not previous_step.convert:
            return Path(previous.checkpoint)
        published = Path(previous.universal)
        marker = published.parent / LATEST_UNIVERSAL  # where this run published it (an older cona: shared)
        universal = resolve_checkpoint(marker)
        if universal.resolve() != published.resolve():
            raise ChainError(
                f"{marker} names {universal.name}, not {published.name} that step {previous.step_num} "
                f"published; does another run of this name share --workdir {self.run.workdir}?"
            )
        return universal

    def hands_over(self, state: RunState, step_num: int) -> bool:
        """A step hands its state over when the next step keeps its layout (with ``--switch-in-place``)."""
        if not self.in_place or step_num == len(self.chain.steps):
            return False
        following = self.strategy(step_num + 1)
        return self.strategy(step_num).same_layout(following, keep_mbs=not self.in_place_mbs)

    def warm_micro_batches(self, state: RunState, step_num: int) -> tuple[int, ...]:
        """The mbs of the later steps that this step's state reaches in place: their graphs compile in a
        helper process while it trains (:mod:`cona.engine.compile_warmup`)."""
        sizes, number = [], step_num
        while number < len(self.chain.steps) and self.hands_over(state, number):
            number += 1
            sizes.append(self.strategy(number).mbs)
        return tuple(sizes)

    def recorded_result(self, stage: StageState, result_path: Path) -> StageResult | None:
        return finished_result(stage, result_path)

    def check_result(self, stage: StageState, result: StageResult, spec: StageSpec) -> None:
        if result.reason != "completed" or result.last_iteration != stage.target_iteration:
            raise LaunchError(
                f"stage {stage.step_num} stopped at iteration {result.last_iteration} ({result.reason}) "
                f"instead of its target {stage.target_iteration}"
            )
        if result.checkpoint is None and not result.handed_over:
            raise LaunchError(f"stage {stage.step_num} saved no checkpoint at its end ({spec.result_path})")

    @contextlib.contextmanager
    def beside(self, stage: StageState, spec: StageSpec) -> Iterator[None]:
        yield  # a chain's stages end by their stop rule only

    def after_training(self, state: RunState, stage: StageState) -> RunState:
        return state

    def publishes(self, state: RunState, stage: StageState) -> bool:
        return self.step(stage.step_num).convert and stage.checkpoint is not None

    def prune(self, stage: StageState) -> tuple[str, ...]:
        removed: list[str] = []
        for rule in self.chain.rules_after(stage.step_num):
            result = prune(rule, self.layout_dir(self.step(rule.stage)))
            self.out(
                f"stage {stage.step_num}: pruned {result.layout_dir} ({rule.mode}): removed "
                f"{', '.join(result.removed) or 'nothing'}"
            )
            removed.extend(str(result.layout_dir / name) for name in result.removed)
        return tuple(removed)

    def stage_done(self, state: RunState, step_num: int) -> None:
        pass

    def finish(self, state: RunState) -> None:
        if self.finished_before:  # the first line said so
            return
        last = state.stages[-1]
        self.out(
            f"run {self.run.run_dir.name} finished: {len(self.chain.steps)} stages, iteration "
            f"{last.last_iteration}, consumed_samples={last.consumed_samples}, "
            f"consumed_tokens={last.consumed_tokens}"
        )
