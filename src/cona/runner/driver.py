"""The one stage driver: every mode's stages move through the same state machine here.

Each stage goes ``pending -> running -> trained -> published -> pruned -> done`` (:mod:`cona.runner.state`):
the driver plans it (start and stop iteration, checkpoint to load, LR factors; fixed at its first launch),
writes its spec, launches its workers through the backend's launcher, reads its result, publishes its
checkpoint when the next stage needs another layout, prunes, and records what the switch into it cost.
Every move is saved in ``runner_state.json`` before the next, so rerunning the same command after a kill
continues where the run stood.

Where the stages come from is the :class:`Schedule`'s business: a chain file
(:class:`cona.runner.schedules.chain_schedule.ChainSchedule`; a fixed strategy is a one-step chain) or the
online policy deciding the next stage while the current one trains
(:class:`cona.runner.schedules.online.OnlineSchedule`). The backend (the native engine, or
:mod:`cona.backends.megatron_deepspeed`) supplies how a stage is launched and how its checkpoint is
published; across nodes the launcher announces each stage to the other nodes
(:mod:`cona.runner.nodes.across_nodes`).

**In place.** A switch that keeps the layout may leave the model, optimizer and data in the workers' memory
instead of going through a checkpoint, when the launcher keeps its workers between stages
(:class:`cona.runner.worker_session.WorkerSession`): the stage before it hands its state over (it saves
nothing, its ``checkpoint`` stays None) and the stage continues it. A kill loses that state; the driver then
retrains it first (:func:`cona.runner.in_place.replay_in_place`). A layout change always goes through the
checkpoint, its publish and its verification.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from cona import run_files
from cona.engine.checkpoint.paths import another_runs_checkpoint, layout_dir, resume_folders, tmp_owner
from cona.engine.spec import StageResult, StageSpec
from cona.errors import CheckpointError, TrainingDiverged
from cona.runner.in_place import replay_in_place
from cona.runner.launch import diverged, stage_master_port
from cona.runner.nodes.across_nodes import node_topology, run_across_nodes
from cona.runner.publish import import_checkpoint_reader_in_background, publish
from cona.runner.run_descriptions import ChainRun, OnlineRun
from cona.runner.run_end import record_runner_end
from cona.runner.run_lock import lock_directory, run_locks
from cona.runner.stage_run import (
    Launcher,
    StageLaunch,
    StageLR,
    checkpoint_dtype,
    launch_stage,
    publish_timed,
    stage_lr,
    switch_check_line,
    write_plan,
)
from cona.runner.state import (
    RunState,
    StageState,
    advance,
    first_attempt_timings,
    own_checkpoint,
    save_state,
    switch_cost,
    trained,
)
from cona.runner.views.run_tracker import RunTracker
from cona.strategy import Strategy

Run = ChainRun | OnlineRun
"""What every run description gives the driver: run_dir, config, workdir, world_size, device_type,
base_port, quiet and nodes."""
Publisher = Callable[[Path], Path]
"""Makes a stage's ``global_step<N>`` checkpoint loadable under another layout: returns the universal
directory it published (with the ``latest_universal`` marker beside it)."""


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What a schedule fixes for a stage at its first launch, besides what the driver fixes itself (its
    start iteration and LR)."""

    target_iteration: int | None
    """The absolute iteration it stops at (None: a token budget or a target perplexity stops it)."""
    load_path: str | None
    """The checkpoint it loads (None: from scratch, or in place)."""
    record: dict[str, Any]
    """``stages/<N>/plan.json``."""
    line: str
    """What the run prints about it."""


class Schedule(Protocol):
    """Where a run's stages come from, and what the modes do differently at each step of a stage."""

    planned_tokens: int
    """The LR schedule's horizon (tokens)."""
    max_tokens: int | None
    """A token budget that stops every stage (None: none)."""
    reports_switch_cost: bool
    """Print the split of each switch's cost when a stage is done."""
    may_publish: bool
    """Whether a stage may publish its checkpoint (a later stage may load it under another layout)."""
    first_iteration: int
    """The iteration the first stage starts at (0, or that of a checkpoint it is given to load)."""

    run_tracker: RunTracker
    """Where the schedule logs its decisions and switches; set by the driver before the first stage."""

    def open(self) -> RunState:
        """Start or resume the run's state (saying which on the first line)."""

    def strategy(self, step_num: int) -> Strategy: ...

    def plan(self, state: RunState, stage: StageState, *, start: int, lr: StageLR, in_place: bool) -> Plan:
        """The stage's plan; ``in_place``: it continues the previous stage's state in memory."""

    def hands_over(self, state: RunState, step_num: int) -> bool:
        """Whether the stage, at its stop rule, hands its state to the next stage in place."""

    def warm_micro_batches(self, state: RunState, step_num: int) -> tuple[int, ...]:
        """Micro-batch sizes the session may switch to in place after the stage (compiled beside it)."""

    def recorded_result(self, stage: StageState, result_path: Path) -> StageResult | None:
        """A result the stage's workers wrote after the runner was killed, if it counts."""

    def check_result(self, stage: StageState, result: StageResult, spec: StageSpec) -> None:
        """Raise when the stage ended in a way this schedule does not accept."""

    def beside(self, stage: StageState, spec: StageSpec) -> AbstractContextManager[None]:
        """What runs beside the stage's workers while they train (the online search)."""

    def after_training(self, state: RunState, stage: StageState) -> RunState:
        """The state once the stage trained (online: the next stage recorded when it asked for a switch)."""

    def publishes(self, state: RunState, stage: StageState) -> bool:
        """Whether the trained stage's checkpoint is published as universal."""

    def prune(self, stage: StageState) -> tuple[str, ...]:
        """Apply the stage's pruning; returns the directories removed."""

    def stage_done(self, state: RunState, step_num: int) -> None:
        """The stage is done (online: the policy's memory moves to the next stage)."""

    def finish(self, state: RunState) -> None:
        """The run ended: what is left to write or print."""


def keeps_workers(launcher: Launcher) -> bool:
    """Whether the launcher runs consecutive stages in the same processes (so a stage can hand its state to
    the next in place)."""
    return bool(getattr(launcher, "keeps_workers", False))


def in_place_mbs(launcher: Launcher) -> bool:
    """Whether the launcher's in-place switches may also change mbs (the native engine's may; a backend
    that changes only the gbs in place says ``in_place_mbs = False``)."""
    return bool(getattr(launcher, "in_place_mbs", True))


def drive(
    run: Run,
    schedule_of: Callable[[Launcher], Schedule],
    *,
    launcher: Launcher,
    out: Callable[[str], None],
    publisher: Publisher = publish,
    prepare_publisher: Callable[[], object] | None = import_checkpoint_reader_in_background,
    remote_command: Sequence[str] = (),
) -> RunState:
    """Run (or resume) ``run`` to its end with the schedule ``schedule_of(launcher)`` makes; returns the
    final run state. Across nodes node 0 drives and announces every stage, the other nodes run their share
    of each (``remote_command``: the command node 0 starts them with over ssh). ``prepare_publisher`` runs
    once before the first stage of a run that may publish."""
    with run_locks():  # whatever the run locked is free again when it ends

        def drive_with(stage_launcher: Launcher) -> RunState:
            driver = StageDriver(
                run=run,
                schedule=schedule_of(stage_launcher),
                launcher=stage_launcher,
                publisher=publisher,
                out=out,
            )
            return driver.drive(prepare_publisher)

        if run.nodes.num_nodes == 1:
            return drive_with(launcher)
        return run_across_nodes(
            run_dir=run.run_dir,
            nodes=run.nodes,
            base_port=run.base_port,
            timeout_s=run.config.training.runtime.distributed_timeout_minutes * 60.0,
            world_size=run.world_size,
            device_type=run.device_type,
            quiet=run.quiet,
            launcher=launcher,
            out=out,
            remote_command=remote_command,
            drive=drive_with,
        )


class StageDriver:
    """Drives the stages of one run, from wherever its state stands to its end."""

    def __init__(
        self,
        *,
        run: Run,
        schedule: Schedule,
        launcher: Launcher,
        publisher: Publisher,
        out: Callable[[str], None],
    ) -> None:
        self.run, self.schedule, self.out = run, schedule, out
        self.launcher, self.publisher = launcher, publisher
        self.dtype = checkpoint_dtype(run.config.training, run.device_type)
        self.handed_over: int | None = None
        """The stage whose state the session's workers hold in memory for the next stage."""

    def drive(self, prepare_publisher: Callable[[], object] | None = None) -> RunState:
        # before the run state is read: one runner at a time
        lock_directory(self.run.run_dir, "run directory")
        try:
            state = self._drive(prepare_publisher)
        except BaseException as error:
            record_runner_end(self.run.run_dir, error)  # for cona status, once the run's processes are gone
            raise
        record_runner_end(self.run.run_dir, None)
        return state

    def _drive(self, prepare_publisher: Callable[[], object] | None) -> RunState:
        state = self.schedule.open()
        if state.current is not None:
            if prepare_publisher is not None and self.schedule.may_publish:
                prepare_publisher()
            with RunTracker.open(self.run.config, self.run.run_dir, self.out) as tracker:
                self.schedule.run_tracker = tracker  # decisions and switches for TensorBoard / W&B
                while (current := state.current) is not None:
                    state = self.drive_stage(state, current.step_num)
        self.schedule.finish(state)
        return state

    def layout_dir(self, step_num: int) -> Path:
        """The run's own checkpoint folder of stage ``step_num``'s layout."""
        strategy = self.schedule.strategy(step_num)
        return layout_dir(
            self.run.workdir, self.run.config, strategy, self.dtype, run_name=self.run.run_dir.name
        )

    def resume_folders(self, step_num: int) -> tuple[Path, ...]:
        """Where a relaunch of stage ``step_num`` looks for what it saved (the run's folder, then an older
        cona's shared one)."""
        strategy = self.schedule.strategy(step_num)
        return resume_folders(
            self.run.workdir, self.run.config, strategy, self.dtype, run_name=self.run.run_dir.name
        )

    def save(self, state: RunState, stage: StageState) -> RunState:
        state = state.with_stage(stage)
        save_state(self.run.run_dir, state)
        return state

    @staticmethod
    def continues_in_place(state: RunState, step_num: int) -> bool:
        """Whether stage ``step_num`` continues the state the stage before handed over in memory: that stage
        trained and saved nothing (a stage that saved nothing without handing over is refused)."""
        if step_num == 1:
            return False
        previous = state.stage(step_num - 1)
        return previous.status not in ("pending", "running") and previous.checkpoint is None

    # --- the state machine ------------------------------------------------------------------------------

    def drive_stage(self, state: RunState, number: int) -> RunState:
        """Drive one stage from wherever its status stands to done; every move is saved before the next."""
        if state.stage(number).status in ("pending", "running"):
            state = self._train(state, number)
        stage = state.stage(number)
        if stage.status == "trained":
            state = self.schedule.after_training(state, stage)
            publishes = self.schedule.publishes(state, stage)
            changes = publish_timed(self.publisher, stage, self.out) if publishes else {}
            stage = advance(stage, "published", **changes)
            state = self.save(state, stage)
        if stage.status == "published":
            stage = advance(stage, "pruned", pruned=self.schedule.prune(stage))
            state = self.save(state, stage)
        if stage.status == "pruned":
            cost = switch_cost(state.stage(number - 1), stage) if number > 1 else {}
            if cost and self.schedule.reports_switch_cost:
                parts = ", ".join(
                    f"{key.removesuffix('_s').replace('_', ' ')} {value:.2f} s" for key, value in cost.items()
                )
                self.out(f"switch {number - 1}->{number}: {parts}; total {sum(cost.values()):.2f} s")
            state = self.save(state, advance(stage, "done", switch_cost=cost))
        self.schedule.stage_done(state, number)
        return state

    def _train(self, state: RunState, number: int) -> RunState:
        if state.stage(number).status == "pending":
            state = self.save(state, self._plan(state, state.stage(number)))
        stage = state.stage(number)
        spec = self.stage_spec(state, stage)
        result, launched = self.schedule.recorded_result(stage, spec.result_path), None
        if result is None and stage.attempts > 0 and not self.run.resume_diverged:
            refuse_diverged(spec.stage_dir, number, spec.load_path)
        if result is None and spec.continue_in_place and self.handed_over != number - 1:
            self._replay(state, number)  # a kill lost the state kept in memory
        if result is None:
            state, launched = self._launch(state, spec, number)
            result = StageResult.read(spec.result_path)
        # Only workers this runner launched hold a state: a result recorded before a kill names gone ones.
        self.handed_over = number if result.handed_over and launched is not None else None
        self.schedule.check_result(stage, result, spec)
        stage = trained(state.stage(number), result, launched, first_attempt_timings(spec.switch_in_path))
        line = switch_check_line(stage)
        if line is not None:
            self.out(line)
        return self.save(state, stage)

    def _plan(self, state: RunState, stage: StageState) -> StageState:
        """Fix the stage's start, stop, load path and LR factors (kept for every relaunch)."""
        number = stage.step_num
        start = state.stage(number - 1).last_iteration if number > 1 else self.schedule.first_iteration
        lr = stage_lr(self.run.run_dir, self.run.config.training, self.schedule.strategy(number).gbs, start)
        in_place = self.continues_in_place(state, number)
        plan = self.schedule.plan(state, stage, start=start, lr=lr, in_place=in_place)
        self.out(plan.line)
        return advance(
            stage,
            "running",
            start_iteration=start,
            target_iteration=plan.target_iteration,
            load_path=plan.load_path,
            planned_at=write_plan(self.run.run_dir, number, plan.record),
            lr_factor=lr.lr_factor,
            min_lr_factor=lr.min_lr_factor,
        )

    def stage_spec(self, state: RunState, stage: StageState) -> StageSpec:
        """The spec of the stage's next attempt: from its own newest checkpoint if an attempt saved one (a
        periodic one, or its last), else from what it planned to load, or in place. It saves periodically
        as ``training.save_interval`` and ``save_interval_minutes`` say."""
        # A token budget has no stop iteration: any iteration past the start is the stage's own.
        span = dataclasses.replace(stage, target_iteration=stage.target_iteration or sys.maxsize)
        own = own_checkpoint(span, self.resume_folders(stage.step_num), owner=tmp_owner(self.run.run_dir))
        load_path = own if own is not None else (Path(stage.load_path) if stage.load_path else None)
        in_place = own is None and self.continues_in_place(state, stage.step_num)
        return StageSpec(
            continue_in_place=in_place,
            start_iteration=stage.start_iteration if in_place else None,
            hand_over_in_place=self.schedule.hands_over(state, stage.step_num),
            run_dir=self.run.run_dir,
            config=self.run.config,
            strategy=self.schedule.strategy(stage.step_num),
            stage=stage.step_num,
            workdir=self.run.workdir,
            planned_tokens=self.schedule.planned_tokens,
            load_path=load_path,
            target_iteration=stage.target_iteration,
            max_tokens=self.schedule.max_tokens,
            lr_factor=stage.lr_factor,
            min_lr_factor=stage.min_lr_factor,
            save_at_end=True,
            save_interval=self.run.config.training.checkpoint.save_interval,
            save_interval_minutes=self.run.config.training.checkpoint.save_interval_minutes,
            warm_micro_batches=self.schedule.warm_micro_batches(state, stage.step_num),
        )

    # --- launching --------------------------------------------------------------------------------------

    def _launch(self, state: RunState, spec: StageSpec, number: int) -> tuple[RunState, float]:
        """Start one attempt of the stage and wait for it; returns the state (attempt counted) and the time
        it was launched. Refused before it starts where its last save would replace another run's
        checkpoint."""
        if spec.target_iteration is not None:
            final = self.layout_dir(number) / f"global_step{spec.target_iteration}"
            refusal = another_runs_checkpoint(final, tmp_owner(self.run.run_dir))
            if refusal is not None:
                raise CheckpointError(f"stage {number}: {refusal}")
        spec_path = spec.write(spec.stage_dir / run_files.SPEC)
        spec.result_path.unlink(missing_ok=True)
        spec.switch_request_path.unlink(missing_ok=True)  # an earlier attempt's request is not this one's
        stage = state.stage(number)
        state = self.save(state, dataclasses.replace(stage, attempts=stage.attempts + 1))
        with self.schedule.beside(stage, spec):
            launched = launch_stage(self.launcher, self._stage_launch(spec, spec_path, number))
        return state, launched

    def _stage_launch(self, spec: StageSpec, spec_path: Path, number: int) -> StageLaunch:
        port = stage_master_port(self.run.base_port, number)
        return StageLaunch(
            spec=spec,
            spec_path=spec_path,
            topology=node_topology(self.run.nodes, self.run.world_size, port),
            device_type=self.run.device_type,
            quiet=self.run.quiet,
        )

    def _replay(self, state: RunState, number: int) -> None:
        """Rebuild in the session's workers the state stage ``number`` continues in place."""
        replay_in_place(
            state,
            number,
            continues_in_place=lambda step_num: self.continues_in_place(state, step_num),
            spec_of=lambda stage: self.stage_spec(state, stage),
            launch=lambda spec, spec_path, step_num: launch_stage(
                self.launcher, self._stage_launch(spec, spec_path, step_num)
            ),
            out=self.out,
        )
        self.handed_over = number - 1


def refuse_diverged(stage_dir: Path, number: int, load_path: Path | None) -> None:
    """Refuse to relaunch a stage whose last attempt stopped because training diverged: the same command
    would train on from its newest checkpoint into the same divergence."""
    message = diverged(stage_dir)
    if message is not None:
        where = f" from {load_path}" if load_path is not None else ""
        raise TrainingDiverged(
            f"stage {number} stopped diverged ({message}); rerun with --fresh to start over, "
            f"or pass --resume-diverged to resume it{where} anyway"
        )


def start_text(load_path: str | None, in_place: bool) -> str:
    """How a stage starts, for its plan line."""
    if in_place:
        return "continuing in place (the state stays in the workers)"
    return f"load {load_path or 'none (from scratch)'}"
