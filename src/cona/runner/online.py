"""Online strategy chaining (``cona train --gpus N --system S --initial-gbs G0 --max-gbs G ...``).

A chain whose next step is decided while it trains. Stage 1 runs the best strategy the search finds for
``G0``; beside every stage a search thread (:mod:`cona.runner.online_search`) reads ``metrics.jsonl`` and
asks the policy whether the frontier's best strategy pays for a switch. When it does, the workers save at
the next step boundary and exit; the runner records the new stage, publishes the checkpoint, rescales the
LR for the new gbs (``training.lr_scale_strategy``; adascale with the noise scale measured so far) and
launches the next stage from the published copy. The run stops at ``--total-iters``, ``--total-tokens``
or the first evaluation at or below ``--target-ppl``.

The run state is the chain runner's (``runner_state.json``, :mod:`cona.runner.state`), grown by one stage
per switch; the strategies chosen so far are kept in ``online_stages.json``. Rerunning the same command
after a kill continues where the run stood. At the end ``realized_chain.json`` is a chain file that
``cona train --chain`` replays to the same strategies and consumed samples, and a table summarises the
stages.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

from cona.engine.spec import STOP_REASONS, StageResult, StageSpec
from cona.errors import ChainError, LaunchError
from cona.planner.policy import Candidate
from cona.planner.systems import load_system
from cona.runner.across_nodes import node_topology, run_across_nodes
from cona.runner.chain import content_digest
from cona.runner.in_place import replay_in_place
from cona.runner.launch import stage_master_port
from cona.runner.multinode import cona_command
from cona.runner.online_memory import Memory, resumed_memory
from cona.runner.online_options import OnlineRun
from cona.runner.online_report import print_summary, realized_chain
from cona.runner.online_search import Budget, FrontierSearch, PendingSwitch, StageOutcome, StageSearch
from cona.runner.online_stages import STAGES_NAME, StageRecords
from cona.runner.publish import publish
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
    check_same_run,
    load_state,
    own_checkpoint,
    save_state,
    saved_result,
    switch_cost,
    trained,
)
from cona.strategy import Strategy

REALIZED_NAME = "realized_chain.json"


class _Runner:
    def __init__(self, run: OnlineRun, launcher: Launcher, out: Callable[[str], None]) -> None:
        self.run, self.launcher, self.out = run, launcher, out
        training = run.config.training
        self.dtype = checkpoint_dtype(training, run.device_type)
        system = load_system(run.system)
        self.frontier = FrontierSearch(
            config=run.config,
            system=system,
            n_gpus=run.world_size,
            dtype=system.resolve_dtype(self.dtype),
            botorch=run.botorch,
        )
        self.budget = Budget(
            total_iters=run.total_iters,
            total_tokens=run.total_tokens if run.total_tokens is not None else training.lr_decay_tokens,
            target_ppl=run.target_ppl,
            seq=run.config.model.seq,
        )
        self.records = StageRecords(run.run_dir)
        self.in_place = getattr(launcher, "keeps_workers", False)
        """Whether a switch that keeps the layout can keep the state in the workers (a session)."""
        self.handed_over: int | None = None
        """The stage whose state the session's workers hold in memory for the next stage."""

    # --- run state -------------------------------------------------------------------------------------

    def open(self) -> RunState:
        run, run_dir = self.run, self.run.run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        if run.fresh:
            for name in ("runner_state.json", STAGES_NAME, "metrics.jsonl", "decisions.jsonl",
                         "switch_request.json", REALIZED_NAME):  # fmt: skip
                (run_dir / name).unlink(missing_ok=True)
            import shutil

            shutil.rmtree(run_dir / "stages", ignore_errors=True)
        config_digest = content_digest(run.config.to_dict())
        state = load_state(run_dir)
        point_latest(run_dir)
        if state is not None:
            check_same_run(
                state,
                run_dir=run_dir,
                chain_digest=run.identity(),
                config_digest=config_digest,
                world_size=run.world_size,
            )
            self.records.load()
            self.out(f"resuming online run {run_dir.name} at stage {len(state.stages)} ({run_dir})")
            return state
        first = self.frontier(run.initial_gbs)
        if first is None:
            raise ChainError(
                f"no strategy for {run.world_size} processes at --initial-gbs {run.initial_gbs} fits and "
                f"trains under this config"
            )
        self.records.add(first, action="initial", reason=f"best strategy at --initial-gbs {run.initial_gbs}")
        state = RunState(
            chain_path="online",
            chain_digest=run.identity(),
            config_digest=config_digest,
            world_size=run.world_size,
            stages=(StageState(step_num=1),),
        )
        save_state(run_dir, state)
        self.out(f"starting online run {run_dir.name} (run directory {run_dir})")
        return state

    def strategy(self, step_num: int) -> Strategy:
        return self.records.strategy(step_num)

    def candidate(self, step_num: int) -> Candidate:
        return self.records.candidate(step_num)

    def layout_dir(self, step_num: int) -> Path:
        from cona.engine.checkpoint import layout_dir

        return layout_dir(self.run.workdir, self.run.config, self.strategy(step_num), self.dtype)

    def save(self, state: RunState, stage: StageState) -> RunState:
        state = state.with_stage(stage)
        save_state(self.run.run_dir, state)
        return state

    def memory(self, state: RunState) -> Memory:
        """The policy's memory at the start of the current stage (rebuilt from the files after a resume)."""
        return resumed_memory(self.run, state, self.records, in_place=self.in_place)

    # --- one stage -------------------------------------------------------------------------------------

    def run_stage(self, state: RunState, memory: Memory) -> tuple[RunState, Memory]:
        current = state.current
        assert current is not None
        number = current.step_num
        outcome = None
        if current.status in ("pending", "running"):
            state, outcome = self._train(state, memory)
        stage = state.stage(number)
        if stage.status == "trained" and len(state.stages) == number:
            state = self._maybe_next(state, stage, outcome)
        stage = state.stage(number)
        has_next = len(state.stages) > number
        if stage.status == "trained":
            changes = publish_timed(publish, stage, self.out) if has_next and stage.checkpoint else {}
            stage = advance(stage, "published", **changes)
            state = self.save(state, advance(stage, "pruned"))
        stage = state.stage(number)
        if stage.status == "pruned":
            cost = switch_cost(state.stage(number - 1), stage) if number > 1 else {}
            state = self.save(state, advance(stage, "done", switch_cost=cost))
        if outcome is not None:
            memory = Memory(
                settings=outcome.settings, policy_state=outcome.policy_state, tracker=outcome.tracker
            )
            if has_next and outcome.decision is not None:
                done = state.stage(number)
                memory.pending = PendingSwitch(
                    new=self.candidate(number + 1),
                    old_measured_tokens_per_s=outcome.measured_tokens_per_s or 0.0,
                    handoff_s=done.timings.get("save_s", 0.0) + done.timings.get("publish_s", 0.0),
                    in_place=self.records.continues_in_place(number + 1),
                )
        elif has_next:
            memory = self.memory(state)
        return state, memory

    def _train(self, state: RunState, memory: Memory) -> tuple[RunState, StageOutcome | None]:
        current = state.current
        assert current is not None
        if current.status == "pending":
            current = self._plan(state, current)
            state = self.save(state, current)
        spec = self._spec(current)
        result, outcome, launched = saved_result(current, spec.result_path), None, None
        if result is None and spec.continue_in_place and self.handed_over != current.step_num - 1:
            # a kill lost the state kept in memory
            replay_in_place(
                self.records,
                state,
                current.step_num,
                spec_of=self._spec,
                launch=self._launch_now,
                out=self.out,
            )
            self.handed_over = current.step_num - 1
        if result is None:
            spec_path = spec.write(spec.stage_dir / "spec.json")
            spec.result_path.unlink(missing_ok=True)
            spec.switch_request_path.unlink(missing_ok=True)
            state = self.save(state, dataclasses.replace(current, attempts=current.attempts + 1))
            search = StageSearch(
                run_dir=self.run.run_dir,
                stage=current.step_num,
                launched_at=time.time(),
                settings=memory.settings,
                policy_state=memory.policy_state,
                tracker=memory.tracker,
                frontier=self.frontier,
                budget=self.budget,
                pending=memory.pending,
                noise_scale_floor=self.run.noise_scale_floor,
                # a switch costs at least a restart, unless the cost to assume was given
                startup_prices_switch="predicted_switch_cost_s" not in self.run.policy_overrides,
                metrics_offset=_size(spec.metrics_path),
                out=self.out,
                print_stays=not self.run.quiet,  # quiet mode: stage lines, switches and stops only
            )
            search.start()
            try:
                launched = launch_stage(self.launcher, self._launch(spec, spec_path, current.step_num))
            finally:
                outcome = search.stop()
            result = StageResult.read(spec.result_path)
        self.handed_over = current.step_num if result.handed_over else None
        self._check_result(current, result)
        stage = trained(state.stage(current.step_num), result, launched)
        line = switch_check_line(stage)
        if line is not None:
            self.out(line)
        return self.save(state, stage), outcome

    def _check_result(self, stage: StageState, result: StageResult) -> None:
        if result.checkpoint is None and not result.handed_over:
            raise LaunchError(f"stage {stage.step_num} saved no checkpoint at its end")
        if result.reason in STOP_REASONS:
            return
        raise LaunchError(f"stage {stage.step_num} stopped for an unknown reason {result.reason!r}")

    def _maybe_next(self, state: RunState, stage: StageState, outcome: StageOutcome | None) -> RunState:
        """Record the next stage when the stage ended on a switch request (read back from the request
        file, which stays until the next stage is recorded, so this survives a kill)."""
        request_path = self.run.run_dir / "switch_request.json"
        result = StageResult.read(self.run.run_dir / "stages" / str(stage.step_num) / "stage_result.json")
        if result.reason not in ("switch_requested", "switch_in_place") or not request_path.is_file():
            request_path.unlink(missing_ok=True)
            return state
        request = json.loads(request_path.read_text())
        if request["action"] in ("switch", "fallback"):
            target = Candidate(
                strategy=Strategy(**request["strategy"]),
                predicted_tokens_per_s=request["predicted_tokens_per_s"],
                throughput_source=request.get("throughput_source", "predicted"),
                trial=request.get("trial", False),
            )
            in_place = request.get("in_place") is True and result.handed_over
            self.records.add(target, action=request["action"], reason=request["reason"], in_place=in_place)
            state = dataclasses.replace(
                state, stages=(*state.stages, StageState(step_num=stage.step_num + 1))
            )
            save_state(self.run.run_dir, state)
            how = " in place" if in_place else ""
            self.out(
                f"stage {stage.step_num} -> {stage.step_num + 1}: {request['action']}{how} to "
                f"{target.strategy.short()} at iteration {stage.last_iteration}"
            )
        request_path.unlink()
        return state

    def _plan(self, state: RunState, stage: StageState) -> StageState:
        training = self.run.config.training
        number = stage.step_num
        previous = state.stage(number - 1) if number > 1 else None
        start = previous.last_iteration if previous is not None else 0
        load_path = (previous.universal or previous.checkpoint) if previous is not None else None
        if self.records.continues_in_place(number):
            load_path = None  # the state stays in the workers' memory
        strategy = self.strategy(number)
        lr = stage_lr(self.run.run_dir, training, strategy.gbs, start)
        plan = {"start_iteration": start, "load_path": load_path, "lr": lr.scaled.lr,
                "min_lr": lr.scaled.min_lr, "strategy": dataclasses.asdict(strategy)}  # fmt: skip
        self.out(
            f"stage {number}: {strategy.short()} from iteration {start}, lr {lr.scaled.lr:.3g} "
            f"(x{lr.lr_factor:.3g}), {_start_text(load_path, self.records.continues_in_place(number))}"
        )
        return advance(
            stage,
            "running",
            start_iteration=start,
            target_iteration=self.run.total_iters,
            load_path=load_path,
            planned_at=write_plan(self.run.run_dir, number, plan),
            lr_factor=lr.lr_factor,
            min_lr_factor=lr.min_lr_factor,
        )

    def _spec(self, stage: StageState) -> StageSpec:
        # A token budget has no stop iteration: any iteration past the start is the stage's own.
        span = dataclasses.replace(stage, target_iteration=stage.target_iteration or sys.maxsize)
        own = own_checkpoint(span, self.layout_dir(stage.step_num))
        load_path = own if own is not None else (Path(stage.load_path) if stage.load_path else None)
        in_place = own is None and self.records.continues_in_place(stage.step_num)
        return StageSpec(
            continue_in_place=in_place,
            start_iteration=stage.start_iteration if in_place else None,
            run_dir=self.run.run_dir,
            config=self.run.config,
            strategy=self.strategy(stage.step_num),
            stage=stage.step_num,
            workdir=self.run.workdir,
            planned_tokens=self.run.planned_tokens,
            load_path=load_path,
            target_iteration=self.run.total_iters,
            max_tokens=self.budget.total_tokens,
            lr_factor=stage.lr_factor,
            min_lr_factor=stage.min_lr_factor,
            save_at_end=True,
        )

    def _launch_now(self, spec: StageSpec, spec_path: Path, number: int) -> None:
        launch_stage(self.launcher, self._launch(spec, spec_path, number))

    def _launch(self, spec: StageSpec, spec_path: Path, number: int) -> StageLaunch:
        port = stage_master_port(self.run.base_port, number)
        topology = node_topology(self.run.nodes, self.run.world_size, port)
        return StageLaunch(
            spec=spec, spec_path=spec_path, topology=topology, device_type=self.run.device_type,
            quiet=self.run.quiet,
        )  # fmt: skip


def _start_text(load_path: str | None, in_place: bool) -> str:
    if in_place:
        return "continuing in place (the state stays in the workers)"
    return f"load {load_path or 'none (from scratch)'}"


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else 0


def run_online(
    run: OnlineRun,
    *,
    launcher: Launcher = torchrun_launcher,
    out: Callable[[str], None] = print,
) -> RunState:
    """Run (or resume) an online run to its end; writes realized_chain.json and prints the summary.

    Across nodes node 0 searches, decides and announces every stage; the other nodes run their share of
    each (:mod:`cona.runner.across_nodes`)."""
    with run_locks():  # whatever the run locked is free again when it ends
        if run.nodes.num_nodes == 1:
            return _drive_online(run, launcher, out)
        remote_command = cona_command(
            run.mode_args(),
            config=run.config,
            nodes=run.nodes,
            run_dir=run.run_dir,
            workdir=run.workdir,
            base_port=run.base_port,
            quiet=run.quiet,
        )
        return run_across_nodes(
            run_dir=run.run_dir,
            nodes=run.nodes,
            timeout_s=run.config.training.distributed_timeout_minutes * 60.0,
            world_size=run.world_size,
            device_type=run.device_type,
            quiet=run.quiet,
            launcher=launcher,
            out=out,
            remote_command=remote_command,
            drive=lambda coordinated: _drive_online(run, coordinated, out),
        )


def _drive_online(run: OnlineRun, launcher: Launcher, out: Callable[[str], None]) -> RunState:
    lock_directory(run.run_dir, "run directory")  # before the run state is read: one runner at a time
    runner = _Runner(run, launcher, out)
    state = runner.open()
    if run.noise_scale_floor is not None:
        out(
            f"decisions assume a noise scale of at least {run.noise_scale_floor:g} samples (the measured one "
            f"is logged beside it); policy settings overridden: {run.policy_overrides or 'none'}"
        )
    if state.current is not None:
        memory = runner.memory(state)
        while state.current is not None:
            state, memory = runner.run_stage(state, memory)
    chain = realized_chain(state, runner.records.entries)
    (run.run_dir / REALIZED_NAME).write_text(json.dumps(chain, indent=1) + "\n")
    print_summary(run.run_dir, state, runner.records.entries, target_ppl=run.target_ppl, out=out)
    out(f"realized chain: {run.run_dir / REALIZED_NAME} (cona train --chain replays it)")
    return state
