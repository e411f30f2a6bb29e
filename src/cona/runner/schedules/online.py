"""Online strategy chaining (``cona train --gpus N --system S --initial-gbs G0 --max-gbs G ...``).

A chain whose next step is decided while it trains: the one stage driver (:mod:`cona.runner.driver`) with a
schedule that asks the policy. Stage 1 runs the best strategy the search finds for ``G0``; beside every
stage a search thread (:mod:`cona.runner.schedules.online_search`) reads ``metrics.jsonl`` and asks the
policy whether
the frontier's best strategy pays for a switch. When it does, the workers save at the next step boundary
(or, for a switch that keeps the layout in a worker session, hand their state over in place) and exit; the
schedule records the new stage, the driver publishes the checkpoint, rescales the LR for the new gbs
(``training.lr_scale_strategy``; adascale with the noise scale measured so far) and launches the next stage.
The run stops at ``--total-iters``, ``--total-tokens`` or the first evaluation at or below ``--target-ppl``.

The run state is the driver's (``runner_state.json``, :mod:`cona.runner.state`), grown by one stage per
switch; the strategies chosen so far are kept in ``online_stages.json``. Rerunning the same command after a
kill continues where the run stood. At the end ``realized_chain.json`` is a chain file that
``cona train --chain`` replays to the same strategies and consumed samples, and a table summarises the
stages.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from cona import run_files
from cona.atomic_files import write_json_atomic
from cona.engine.spec import STOP_REASONS, StageResult, StageSpec
from cona.errors import ChainError, LaunchError
from cona.jsonl import read_lines
from cona.planner.policy import Candidate
from cona.planner.probe_rule import ProbeOutcome
from cona.planner.systems import load_system
from cona.runner.chain_file import content_digest
from cona.runner.driver import Plan, Publisher, drive, in_place_mbs, keeps_workers, start_text
from cona.runner.nodes.multinode import cona_command
from cona.runner.publish import import_checkpoint_reader_in_background, publish
from cona.runner.run_descriptions import OnlineRun
from cona.runner.run_dir import point_latest
from cona.runner.schedules.frontier import fit_prior_on_host
from cona.runner.schedules.online_memory import Memory, resumed_memory, tracker_at_resume
from cona.runner.schedules.online_search import (
    Budget,
    FrontierSearch,
    PendingSwitch,
    StageOutcome,
    StageSearch,
    log_not_carried_out,
)
from cona.runner.schedules.online_stages import StageRecords
from cona.runner.stage_run import Launcher, StageLR, checkpoint_dtype, stage_lr, torchrun_launcher
from cona.runner.state import (
    ONLINE_CHAIN,
    RunState,
    StageState,
    check_same_run,
    discard_run,
    load_state,
    save_state,
    saved_result,
)
from cona.runner.views.online_report import print_summary, realized_chain
from cona.runner.views.run_tracker import RunTracker
from cona.strategy import Strategy
from cona.switch_request import SwitchRequest

__all__ = ["OnlineRun", "OnlineSchedule", "run_online"]


def run_online(
    run: OnlineRun,
    *,
    launcher: Launcher = torchrun_launcher,
    out: Callable[[str], None] = print,
    publisher: Publisher = publish,
    prepare_publisher: Callable[[], object] | None = import_checkpoint_reader_in_background,
) -> RunState:
    """Run (or resume) an online run to its end; writes realized_chain.json and prints the summary.
    ``launcher``, ``publisher`` and ``prepare_publisher``: the backend's (the Megatron-DeepSpeed backend
    passes its own).

    Across nodes node 0 searches, decides and announces every stage; the other nodes run their share of
    each (:mod:`cona.runner.nodes.across_nodes`)."""
    remote_command = cona_command(
        run.mode_args(),
        config=run.config,
        nodes=run.nodes,
        run_dir=run.run_dir,
        workdir=run.workdir,
        base_port=run.base_port,
        quiet=run.quiet,
    )
    return drive(
        run,
        lambda stage_launcher: OnlineSchedule(
            run,
            out=out,
            in_place=keeps_workers(stage_launcher),
            in_place_mbs=in_place_mbs(stage_launcher),
        ),
        launcher=launcher,
        out=out,
        publisher=publisher,
        prepare_publisher=prepare_publisher,
        remote_command=remote_command if run.nodes.num_nodes > 1 else (),
    )


class OnlineSchedule:
    """The stages the online policy decides (see :class:`cona.runner.driver.Schedule`)."""

    reports_switch_cost = False  # the summary table at the end shows the switches' costs
    first_iteration = 0

    def __init__(
        self, run: OnlineRun, *, out: Callable[[str], None], in_place: bool, in_place_mbs: bool = True
    ) -> None:
        self.run, self.out = run, out
        training = run.config.training
        system = load_system(run.system)
        self.frontier = FrontierSearch(
            config=run.config,
            system=system,
            n_gpus=run.world_size,
            dtype=system.resolve_dtype(checkpoint_dtype(training, run.device_type)),
            botorch=run.botorch,
            backend=run.backend,
        )
        self.budget = Budget(
            total_iters=run.total_iters,
            total_tokens=run.total_tokens if run.total_tokens is not None else training.lr.lr_decay_tokens,
            target_ppl=run.target_ppl,
            seq=run.config.model.seq,
        )
        self.planned_tokens = run.planned_tokens
        self.max_tokens = self.budget.total_tokens
        self.records = StageRecords(run.run_dir)
        self.in_place = in_place
        """Whether a switch that keeps the layout can keep the state in the workers (a session)."""
        self.may_publish = not in_place or run.world_size > 1  # one GPU in a session: always in place
        self.in_place_mbs = in_place_mbs
        """Whether such a switch may also change mbs (the backend's launcher says)."""
        self.run_tracker = RunTracker.off()
        self.memory: Memory | None = None
        """What the policy carries into the current stage."""
        self.outcome: StageOutcome | None = None
        """What the search beside the current stage ended with (None: it did not run in this process)."""

    def strategy(self, step_num: int) -> Strategy:
        return self.records.strategy(step_num)

    # --- opening the run ----------------------------------------------------------------------------------

    def open(self) -> RunState:
        run, run_dir = self.run, self.run.run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        if run.fresh:
            discard_run(run_dir)
        state = load_state(run_dir)
        point_latest(run_dir)
        if state is not None:
            check_same_run(
                state,
                run_dir=run_dir,
                chain_digest=run.identity(),
                config_digest=content_digest(run.config.identity_dict()),
                world_size=run.world_size,
                workdir=run.workdir,
            )
            self.records.load(len(state.stages))
            self.out(f"resuming online run {run_dir.name} at stage {len(state.stages)} ({run_dir})")
        else:
            state = self._start()
        if run.noise_scale_floor is not None:
            self.out(
                f"decisions assume a noise scale of at least {run.noise_scale_floor:g} samples (the measured "
                f"one is logged beside it); policy settings overridden: {run.policy_overrides or 'none'}"
            )
        if state.current is not None:
            self.memory = self._resumed_memory(state)
        return state

    def _resumed_memory(self, state: RunState) -> Memory:
        return resumed_memory(
            self.run, state, self.records, in_place=self.in_place, in_place_mbs=self.in_place_mbs
        )

    def _start(self) -> RunState:
        run = self.run
        if run.prior_on_host and run.device_type == "cpu" and run.backend == "native":
            per_node = run.world_size if run.nodes.num_nodes == 1 else run.nodes.gpus_per_node
            self.out(fit_prior_on_host(self.frontier, run.config.model, per_node))
        first = self.frontier(run.initial_gbs)
        if first is None:
            raise ChainError(
                f"no strategy for {run.world_size} processes at --initial-gbs {run.initial_gbs} fits and "
                f"trains under this config"
            )
        self.records.add(first, action="initial", reason=f"best strategy at --initial-gbs {run.initial_gbs}")
        state = RunState(
            chain_path=ONLINE_CHAIN,
            chain_digest=run.identity(),
            config_digest=content_digest(run.config.identity_dict()),
            world_size=run.world_size,
            stages=(StageState(step_num=1),),
            workdir=str(Path(run.workdir).resolve()),
        )
        save_state(run.run_dir, state)
        self.out(f"starting online run {run.run_dir.name} (run directory {run.run_dir})")
        return state

    # --- one stage --------------------------------------------------------------------------------------

    def plan(self, state: RunState, stage: StageState, *, start: int, lr: StageLR, in_place: bool) -> Plan:
        number = stage.step_num
        previous = state.stage(number - 1) if number > 1 else None
        load_path = (previous.universal or previous.checkpoint) if previous is not None else None
        if in_place:
            load_path = None  # the state stays in the workers' memory
        strategy = self.strategy(number)
        record = {"start_iteration": start, "load_path": load_path, "lr": lr.scaled.lr,
                  "min_lr": lr.scaled.min_lr, "strategy": dataclasses.asdict(strategy)}  # fmt: skip
        line = (
            f"stage {number}: {strategy.short()} from iteration {start}, lr {lr.scaled.lr:.3g} "
            f"(x{lr.lr_factor:.3g}), {start_text(load_path, in_place)}"
        )
        return Plan(target_iteration=self.run.total_iters, load_path=load_path, record=record, line=line)

    def hands_over(self, state: RunState, step_num: int) -> bool:
        return False  # an online stage hands over in place only when its switch request says so

    def warm_micro_batches(self, state: RunState, step_num: int) -> tuple[int, ...]:
        """Twice the stage's mbs, where an in-place switch may change mbs and the doubled batch stays within
        ``--max-gbs``: the search moves to the next larger gbs, whose best strategy on the same layout
        usually doubles mbs. Its graph compiles in a helper process while the stage trains."""
        strategy = self.strategy(step_num)
        doubled = 2 * strategy.mbs
        if not (self.in_place and self.in_place_mbs) or doubled * strategy.dp > self.run.max_gbs:
            return ()
        return (doubled,)

    def recorded_result(self, stage: StageState, result_path: Path) -> StageResult | None:
        return saved_result(stage, result_path)

    def check_result(self, stage: StageState, result: StageResult, spec: StageSpec) -> None:
        if result.checkpoint is None and not result.handed_over:
            raise LaunchError(f"stage {stage.step_num} saved no checkpoint at its end")
        if result.reason in STOP_REASONS:
            return
        raise LaunchError(f"stage {stage.step_num} stopped for an unknown reason {result.reason!r}")

    @contextlib.contextmanager
    def beside(self, stage: StageState, spec: StageSpec) -> Iterator[None]:
        """The search thread, from the stage's launch until its workers are gone."""
        memory = self.memory
        assert memory is not None
        search = StageSearch(
            run_dir=self.run.run_dir,
            stage=stage.step_num,
            launched_at=time.time(),
            settings=memory.settings,
            policy_state=memory.policy_state,
            tracker=tracker_at_resume(self.run, memory, stage.step_num, spec.load_path),
            frontier=self.frontier,
            budget=self.budget,
            pending=memory.pending,
            noise_scale_floor=self.run.noise_scale_floor,
            # a switch costs at least a restart, unless the cost to assume was given
            startup_prices_switch="predicted_switch_cost_s" not in self.run.policy_overrides,
            metrics_offset=_size(spec.metrics_path),
            out=self.out,
            print_stays=not self.run.quiet,  # quiet mode: stage lines, switches and stops only
            run_tracker=self.run_tracker,
            lr_factors=self._lr_factors,
        )
        search.start()
        try:
            yield
        finally:
            self.outcome = search.stop()

    def _lr_factors(self, gbs: int, iteration: int) -> tuple[float, float]:
        """The LR factors of a stage at ``gbs`` from ``iteration`` (a probe's candidate branch trains so)."""
        lr = stage_lr(self.run.run_dir, self.run.config.training, gbs, iteration)
        return lr.lr_factor, lr.min_lr_factor

    def after_training(self, state: RunState, stage: StageState) -> RunState:
        """Record the next stage when the stage ended on a switch request (read back from the request
        file, which stays until the next stage is recorded, so this survives a kill)."""
        request_path = run_files.switch_request_path(self.run.run_dir)
        if len(state.stages) > stage.step_num:  # recorded before a kill; its request may be left
            request_path.unlink(missing_ok=True)
            return state
        result = StageResult.read(run_files.stage_result_path(self.run.run_dir, stage.step_num))
        request = SwitchRequest.read(request_path) if request_path.is_file() else None
        if result.reason == "switch_in_place":  # a won probe ended the stage, whatever the file says now
            won = won_probe_switch(
                self.run.run_dir, stage.step_num, result.last_iteration, self.strategy(stage.step_num)
            )
            request = won or request
        if result.reason not in ("switch_requested", "switch_in_place") or request is None:
            if request is not None:  # decided after the workers' last boundary check: they completed
                request_path.unlink()  # first: a kill between the two then loses the note, not repeats it
                self._note_unrealized(stage, request)
            return state
        if request.action in ("switch", "fallback"):
            state = self._record_next(state, stage, request, result)
        request_path.unlink()
        return state

    def _note_unrealized(self, stage: StageState, request: SwitchRequest) -> None:
        if request.action not in ("switch", "fallback"):
            return
        record = log_not_carried_out(self.run.run_dir, stage.step_num, request, stage.last_iteration)
        self.out(f"stage {stage.step_num}: {record['reason']}")

    def _record_next(
        self, state: RunState, stage: StageState, request: SwitchRequest, result: StageResult
    ) -> RunState:
        assert request.strategy is not None and request.predicted_tokens_per_s is not None
        target = Candidate(
            strategy=request.strategy,
            predicted_tokens_per_s=request.predicted_tokens_per_s,
            throughput_source=request.throughput_source,
            fitted_on=request.fitted_on,
            on_first_line=request.on_first_line,
        )
        in_place = request.in_place and result.handed_over
        self.records.add(target, action=request.action, reason=request.reason, in_place=in_place)
        state = dataclasses.replace(state, stages=(*state.stages, StageState(step_num=stage.step_num + 1)))
        save_state(self.run.run_dir, state)
        how = " in place" if in_place else ""
        self.out(
            f"stage {stage.step_num} -> {stage.step_num + 1}: {request.action}{how} to "
            f"{target.strategy.short()} at iteration {stage.last_iteration}"
        )
        self.run_tracker.switch(
            stage=stage.step_num + 1, iteration=stage.last_iteration or 0, action=request.action,
            strategy=target.strategy.short(), reason=request.reason, in_place=in_place,
        )  # fmt: skip
        return state

    def publishes(self, state: RunState, stage: StageState) -> bool:
        return len(state.stages) > stage.step_num and stage.checkpoint is not None

    def prune(self, stage: StageState) -> tuple[str, ...]:
        return ()

    def stage_done(self, state: RunState, step_num: int) -> None:
        """Carry the search's outcome into the next stage's memory (or rebuild it from the files)."""
        outcome, self.outcome = self.outcome, None
        has_next = len(state.stages) > step_num
        if outcome is None:
            if has_next:
                self.memory = self._resumed_memory(state)
            return
        memory = Memory(settings=outcome.settings, policy_state=outcome.policy_state, tracker=outcome.tracker)
        if has_next and outcome.decision is not None:
            done = state.stage(step_num)
            memory.pending = PendingSwitch(
                new=self.records.candidate(step_num + 1),
                old_measured_tokens_per_s=outcome.measured_tokens_per_s or 0.0,
                old_rate_measured=outcome.rate_measured,
                handoff_s=done.timings.get("save_s", 0.0) + done.timings.get("publish_s", 0.0),
                in_place=self.records.continues_in_place(step_num + 1),
            )
        self.memory = memory

    def finish(self, state: RunState) -> None:
        run_dir = self.run.run_dir
        chain = realized_chain(state, self.records.entries)
        realized = write_json_atomic(run_dir / run_files.REALIZED_CHAIN, chain)
        print_summary(run_dir, state, self.records.entries, target_ppl=self.run.target_ppl, out=self.out)
        self.out(f"realized chain: {realized} (cona train --chain replays it)")


def won_probe_switch(run_dir: Path, stage: int, ended_at: int, current: Strategy) -> SwitchRequest | None:
    """The switch a probe's candidate won where the stage ended on one (its last line of ``probes.jsonl``
    is a candidate's win that began where the stage ended), else None: the candidate's strategy at the
    rate its branch measured, with the probe's reason. A stop asked for during the probe does not undo it:
    the workers went on from the candidate's branch."""
    records = (line.value for line in read_lines(run_files.probes_path(run_dir)))
    lines = [r for r in records if isinstance(r, dict) and r.get("stage") == stage and "skipped" not in r]
    outcome = ProbeOutcome.from_dict(lines[-1]) if lines else None
    if outcome is None or outcome.winner != "candidate" or outcome.iteration != ended_at:
        return None
    return SwitchRequest(
        action="switch",
        reason=f"probe of gbs {outcome.candidate.gbs}: {outcome.reason}",
        in_place=True,
        strategy=dataclasses.replace(current, gbs=outcome.candidate.gbs, mbs=outcome.candidate.mbs),
        predicted_tokens_per_s=outcome.tokens / outcome.candidate.steady_seconds,
        throughput_source="probed",
    )


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else 0
