"""Run state of a chain (``<run_dir>/runner_state.json``): what lets the same command resume after a kill.

Every stage moves through ``pending -> running -> trained -> published -> pruned -> done``; each step is
recorded (atomically: temporary file, fsync, rename) only after its work is finished, and each piece of
work is idempotent, so a rerun after a SIGKILL anywhere simply redoes the step the state says is next:

- ``running``: training (or the worker's save) was interrupted; the stage is launched again from its newest
  complete checkpoint, with the stop iteration fixed at its first launch (so ``extra_iters`` is not
  counted twice).
- ``trained``: the stage's checkpoint is complete and recorded; publishing is (re)done.
- ``published``: pruning is (re)done.  ``pruned``: only the bookkeeping of ``done`` is left.

The file also names the chain and config it was made for (content hashes, the chain's also per step), so a
run directory is never continued with a different config, nor a chain whose started steps changed
(:mod:`cona.runner.schedules.chain_edit`). Besides the state itself this module reads what a run
directory records for the runner: the checkpoint a resume continues from, a stage result written after the
runner died, and the switch-cost split from the workers' timings (the noise scale measured so far:
:mod:`cona.runner.noise_history`).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from cona import run_files
from cona.atomic_files import write_json_atomic
from cona.engine.checkpoint.files import TRAINER_STATE_FILE
from cona.engine.checkpoint.info import LATEST, read_checkpoint_info
from cona.engine.checkpoint.paths import RUN_KEY, tmp_owner
from cona.engine.spec import StageResult
from cona.errors import ChainError, CheckpointError
from cona.jsonl import read_json
from cona.runner.chain_file import ChainConfig

STATE_NAME = run_files.RUNNER_STATE
ONLINE_CHAIN = "online"
"""The ``chain_path`` of an online run's state: its stages come from the search, not from a file."""
STATE_VERSION = 1
START_OVER = "rerun with --fresh to start over"
Status = Literal["pending", "running", "trained", "published", "pruned", "done"]
STATUSES: tuple[Status, ...] = ("pending", "running", "trained", "published", "pruned", "done")


@dataclass(frozen=True, kw_only=True, slots=True)
class StageState:
    """Progress of one stage."""

    step_num: int
    status: Status = "pending"
    start_iteration: int | None = None
    """Iteration of the checkpoint the stage first loaded (0 for the initial stage)."""
    target_iteration: int | None = None
    """Absolute iteration the stage stops at, fixed at its first launch."""
    load_path: str | None = None
    """The checkpoint the stage first loaded (None: from scratch)."""
    planned_at: float | None = None
    """Filesystem time (mtime of ``stages/<N>/plan.json``) when the stage was planned: a checkpoint or result
    not newer than this is not the stage's own (file times, so the clocks compared are the same one)."""
    attempts: int = 0
    checkpoint: str | None = None
    """The global_step directory the stage saved when it finished."""
    universal: str | None = None
    """The published universal directory (stages with convert)."""
    last_iteration: int | None = None
    consumed_samples: int | None = None
    consumed_tokens: int | None = None
    lr_factor: float = 1.0
    """Peak LR / training.base_lr for this stage's gbs, fixed at its first launch."""
    min_lr_factor: float = 1.0
    """Min LR / training.base_min_lr, fixed at its first launch."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds: process_start_s, load_s, verify_s, first_step_s, probe_s, save_s (from the worker),
    publish_s (runner)."""
    pruned: tuple[str, ...] = ()
    """Universal directories the stage's pruning entries removed."""
    switch_cost: dict[str, float] = field(default_factory=dict)
    """Seconds of the switch into this stage: probe_s, save_s and publish_s of the previous stage, then
    process_start_s, load_s, verify_s and first_step_s of this one."""
    switch_check: dict[str, Any] | None = None
    """The verification of the checkpoint the stage loaded (a :class:`cona.engine.switch_check.Verdict`
    as a dict), from its result; None for a stage that started from scratch."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RunState:
    """The whole run's progress."""

    chain_path: str
    chain_digest: str
    config_digest: str
    world_size: int
    stages: tuple[StageState, ...]
    step_digests: tuple[str, ...] = ()
    """The digest of each chain step as the run took it (:mod:`cona.runner.schedules.chain_edit`); empty
    online."""
    workdir: str | None = None
    """The (resolved) --workdir its checkpoints go to; with the run directory, the run's identity."""

    @property
    def current(self) -> StageState | None:
        """The first stage that is not done (None when the chain is finished)."""
        return next((stage for stage in self.stages if stage.status != "done"), None)

    @property
    def last_finished(self) -> StageState | None:
        """The newest stage whose training finished (its checkpoint and counters are final)."""
        finished = [stage for stage in self.stages if stage.status not in ("pending", "running")]
        return finished[-1] if finished else None

    @property
    def last_published(self) -> str | None:
        published = [stage.universal for stage in self.stages if stage.universal]
        return published[-1] if published else None

    def stage(self, step_num: int) -> StageState:
        return self.stages[step_num - 1]

    def with_stage(self, stage: StageState) -> RunState:
        stages = list(self.stages)
        stages[stage.step_num - 1] = stage
        return dataclasses.replace(self, stages=tuple(stages))


def new_state(
    *, chain_path: Path | str, chain_digest: str, config_digest: str, world_size: int, num_stages: int
) -> RunState:
    return RunState(
        chain_path=str(chain_path),
        chain_digest=chain_digest,
        config_digest=config_digest,
        world_size=world_size,
        stages=tuple(StageState(step_num=number) for number in range(1, num_stages + 1)),
    )


def advance(stage: StageState, status: Status, **changes: Any) -> StageState:
    """The stage moved to ``status`` (never backwards, except ``running`` again on a relaunch)."""
    if STATUSES.index(status) < STATUSES.index(stage.status) and not (
        status == "running" and stage.status == "running"
    ):
        raise AssertionError(f"stage {stage.step_num}: cannot go from {stage.status} back to {status}")
    return dataclasses.replace(stage, status=status, **changes)


SWITCH_IN_PARTS = ("process_start_s", "load_s", "verify_s", "first_step_s")
"""The parts of a switch that the stage switched into spends: measured on its first attempt."""


def trained(
    stage: StageState,
    result: StageResult,
    launched: float | None,
    first_attempt: dict[str, float] | None = None,
) -> StageState:
    """The stage moved to ``trained`` with what its workers' result reports: the checkpoint saved at its
    end, the counters there, the switch parts' seconds (``launched``: when the runner started the attempt,
    None if it was started before a kill) and the verification of the checkpoint it loaded. ``first_attempt``:
    the start milestones of the stage's first attempt that reached a step (``switch_in.json``); when an
    earlier attempt than the result's measured them, its start parts are the switch's, and the relaunch's
    (a stopped or killed run's resume) are not booked as switch cost."""
    timings = durations(result.timings, launched)
    if first_attempt is not None and first_attempt.get("process_start") != result.timings.get(
        "process_start"
    ):
        earlier = durations(first_attempt, first_attempt.get("launch"))
        timings = {key: value for key, value in timings.items() if key not in SWITCH_IN_PARTS}
        timings |= {key: value for key, value in earlier.items() if key in SWITCH_IN_PARTS}
    return advance(
        stage,
        "trained",
        checkpoint=result.checkpoint,
        last_iteration=result.last_iteration,
        consumed_samples=result.consumed_samples,
        consumed_tokens=result.consumed_tokens,
        timings=timings,
        switch_check=result.switch_check,
    )


def state_path(run_dir: Path) -> Path:
    return run_files.runner_state_path(run_dir)


def save_state(run_dir: Path, state: RunState) -> None:
    """Write the state atomically: a kill leaves either the old or the new file, never half of one."""
    write_json_atomic(state_path(run_dir), {"version": STATE_VERSION, **dataclasses.asdict(state)})


def load_state(run_dir: Path) -> RunState | None:
    """The saved state, or None when the run directory has none yet."""
    path = state_path(run_dir)
    try:
        raw = read_json(path)
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as err:
        raise ChainError(f"{path}: unreadable run state ({err.msg}); {START_OVER}") from None
    if not isinstance(raw, dict):
        raise ChainError(f"{path}: damaged run state (not a JSON object); {START_OVER}")
    if raw.pop("version", None) != STATE_VERSION:
        raise ChainError(f"{path}: run state from another cona version; {START_OVER}")
    try:
        stages = tuple(StageState(**one | {"pruned": tuple(one["pruned"])}) for one in raw.pop("stages"))
        return RunState(**raw | {"step_digests": tuple(raw.get("step_digests", ()))}, stages=stages)
    except (TypeError, KeyError) as err:  # a key missing or of the wrong kind: written by hand, or damaged
        raise ChainError(f"{path}: damaged run state ({type(err).__name__}: {err}); {START_OVER}") from None


def open_run(
    run_dir: Path,
    *,
    chain: ChainConfig,
    config_digest: str,
    world_size: int,
    fresh: bool,
    resume_folders: Sequence[Sequence[Path]],
    workdir: Path | None = None,
) -> tuple[RunState, str]:
    """Load the run's state (refusing another chain's or config's) or start a new one (``fresh`` discards the
    old one first). Returns it with the line that says which, naming the checkpoint a resume continues from.
    ``resume_folders``: per step, where a relaunch looks for its own checkpoints
    (:func:`cona.engine.checkpoint.paths.resume_folders`)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if fresh:
        discard_run(run_dir)
    state = load_state(run_dir)
    if state is None:
        state = new_state(
            chain_path=chain.origin,
            chain_digest=chain.digest,
            config_digest=config_digest,
            world_size=world_size,
            num_stages=len(chain.steps),
        )
        workdir_text = str(Path(workdir).resolve()) if workdir is not None else None
        state = dataclasses.replace(state, step_digests=chain.step_digests, workdir=workdir_text)
        save_state(run_dir, state)
        return (
            state,
            f"starting run {run_dir.name}: {len(chain.steps)} stages from {chain.origin} "
            f"(run directory {run_dir})",
        )
    check_same_run(
        state,
        run_dir=run_dir,
        chain_digest=chain.digest,
        config_digest=config_digest,
        world_size=world_size,
        workdir=workdir,
    )
    return state, resume_line(state, run_dir.name, resume_folders, owner=tmp_owner(run_dir))


def discard_run(run_dir: Path) -> None:
    """``--fresh``: remove what an earlier run left in ``run_dir`` (its state, stages and logs)."""
    for name in run_files.FRESH_FILES:
        (run_dir / name).unlink(missing_ok=True)
    shutil.rmtree(run_files.stages_path(run_dir), ignore_errors=True)


def resume_line(
    state: RunState, run_name: str, resume_folders: Sequence[Sequence[Path]], *, owner: str = ""
) -> str:
    """``resuming run X at stage N (status) from <checkpoint>, iteration=..., consumed_samples=...``
    (``owner``: the run's :func:`cona.engine.checkpoint.paths.tmp_owner`)."""
    current = state.current
    if current is None:
        last = state.stages[-1]
        return (
            f"run {run_name} already finished at iteration {last.last_iteration}, consumed_samples="
            f"{last.consumed_samples}; nothing to do (--fresh starts it over)"
        )
    checkpoint = resume_checkpoint(state, current, resume_folders[current.step_num - 1], owner=owner)
    if checkpoint is None:
        return f"resuming run {run_name} at stage {current.step_num} from scratch, consumed_samples=0"
    try:
        trainer_state = read_checkpoint_info(checkpoint).trainer_state
    except CheckpointError:  # another backend's format (Megatron-DeepSpeed): the run state's counters say it
        recorded = state.stage(current.step_num - 1) if current.status == "pending" else current
        trainer_state = {
            "iteration": recorded.last_iteration,
            "consumed_samples": recorded.consumed_samples,
            "consumed_tokens": recorded.consumed_tokens,
        }
    return (
        f"resuming run {run_name} at stage {current.step_num} ({current.status}) from {checkpoint}, "
        f"iteration={trainer_state['iteration']}, consumed_samples={trainer_state['consumed_samples']}, "
        f"consumed_tokens={trainer_state['consumed_tokens']}"
    )


def resume_checkpoint(
    state: RunState, current: StageState, folders: Sequence[Path], *, owner: str = ""
) -> Path | None:
    """The complete checkpoint the run continues from (None: from scratch); ``folders``: the current
    stage's resume folders."""
    if current.status == "pending":
        previous = state.stage(current.step_num - 1) if current.step_num > 1 else None
        found = previous and (previous.universal or previous.checkpoint)
    elif current.status == "running":
        found = own_checkpoint(current, folders, owner) or current.load_path
    else:
        found = current.checkpoint
    return Path(found) if found else None


def check_same_run(
    state: RunState,
    *,
    run_dir: Path,
    chain_digest: str,
    config_digest: str,
    world_size: int,
    workdir: Path | None = None,
) -> None:
    """Refuse to continue a run directory made for another chain, config, process count or workdir."""
    resolved = str(Path(workdir).resolve()) if workdir is not None else None
    mismatches = [
        (state.chain_digest != chain_digest, f"a different chain (it ran {state.chain_path})"),
        (state.config_digest != config_digest, "a different .conaconfig"),
        (state.world_size != world_size, f"{state.world_size} processes, not {world_size}"),
        (None not in (state.workdir, resolved) and state.workdir != resolved, f"--workdir {state.workdir}"),
    ]
    for differs, why in mismatches:
        if differs:
            raise ChainError(
                f"run directory {run_dir} was made for {why}; pass --fresh to start it over, "
                f"or choose another --run-name"
            )


def switch_cost(previous: StageState, stage: StageState) -> dict[str, float]:
    """Cost of the switch into ``stage``: the previous stage's probe loss, save and publish, then this
    stage's process start, checkpoint load, verification and first step (missing parts are left out)."""
    parts = {
        "probe_s": previous.timings.get("probe_s"),
        "save_s": previous.timings.get("save_s"),
        "publish_s": previous.timings.get("publish_s"),
        "process_start_s": stage.timings.get("process_start_s"),
        "load_s": stage.timings.get("load_s"),
        "verify_s": stage.timings.get("verify_s"),
        "first_step_s": stage.timings.get("first_step_s"),
    }
    return {key: value for key, value in parts.items() if value is not None}


def own_checkpoint(stage: StageState, layout_dirs: Sequence[Path], owner: str = "") -> Path | None:
    """The newest complete checkpoint a relaunched stage saved itself before it was interrupted, if any: the
    ``latest`` of the first of ``layout_dirs`` (its resume folders) that has one of the stage's own: its
    trainer_state names this stage (and, where it names a run, run ``owner``), it was written after the
    stage was planned and its iteration lies in the stage's span (a checkpoint of an earlier run or stage
    is none of these)."""
    if stage.attempts == 0 or stage.planned_at is None:
        return None
    for layout_dir in layout_dirs:
        found = _own_latest(stage, Path(layout_dir), owner)
        if found is not None:
            return found
    return None


def _own_latest(stage: StageState, layout_dir: Path, owner: str) -> Path | None:
    if not (layout_dir / LATEST).is_file():
        return None
    try:
        info = read_checkpoint_info(layout_dir)
    except CheckpointError:
        return None
    trainer_state = info.trainer_state
    iteration, saver = trainer_state.get("iteration"), trainer_state.get(RUN_KEY)
    written = (info.path / TRAINER_STATE_FILE).stat().st_mtime
    if trainer_state.get("stage") != stage.step_num or written <= (stage.planned_at or 0.0):
        return None
    if not isinstance(iteration, int) or (owner and isinstance(saver, str) and saver != owner):
        return None
    return info.path if stage.start_iteration < iteration <= stage.target_iteration else None


def first_attempt_timings(path: Path) -> dict[str, float] | None:
    """The start milestones ``switch_in.json`` kept (None: no attempt of the stage reached a step, or the
    file is unreadable)."""
    try:
        raw = read_json(path)
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(raw, dict):
        return None
    return {key: float(value) for key, value in raw.items() if isinstance(value, int | float)}


def saved_result(stage: StageState, result_path: Path) -> StageResult | None:
    """A result whose workers saved a checkpoint after the runner was killed: completed (as
    :func:`finished_result`) or stopped on a switch request (online mode), at any iteration."""
    if stage.attempts == 0 or not result_path.is_file() or result_path.stat().st_mtime <= stage.planned_at:
        return None
    result = StageResult.read(result_path)
    return result if result.checkpoint is not None else finished_result(stage, result_path)


def finished_result(stage: StageState, result_path: Path) -> StageResult | None:
    """The result of an attempt whose workers finished after the runner was killed (it unlinks stale results
    before each launch, so a result newer than the plan is this stage's)."""
    if stage.attempts == 0 or not result_path.is_file() or result_path.stat().st_mtime <= stage.planned_at:
        return None
    result = StageResult.read(result_path)
    complete = result.reason == "completed" and result.last_iteration == stage.target_iteration
    return result if complete else None


def durations(timings: dict[str, float], launched: float | None) -> dict[str, float]:
    """Seconds of the start-up and switch parts, from the worker's unix times: process start (launch until
    the worker runs, its imports included), load (model build, data and checkpoint load), verify (the probe
    loss of the loaded checkpoint), first step (the compile included), probe (the probe loss of the state to
    save) and save; within them, where the worker recorded them: imports (torch and CONA), model (build and
    optimizer) and data (datasets and sample indices). Results of workers that measured no probe have no
    load_done/probe_done: their load and save spans end and start at the neighbours."""
    load_end = timings.get("load_done", timings.get("setup_done"))
    spans = {
        "process_start_s": (launched, timings.get("process_start")),
        "imports_s": (timings.get("imports_start"), timings.get("process_start")),
        "model_s": (timings.get("process_start"), timings.get("model_done")),
        "data_s": (timings.get("model_done"), timings.get("data_done")),
        "load_s": (timings.get("process_start"), load_end),
        "verify_s": (timings.get("load_done"), timings.get("verify_done")),
        "first_step_s": (timings.get("setup_done"), timings.get("first_step_done")),
        "probe_s": (timings.get("train_done"), timings.get("probe_done")),
        "save_s": (timings.get("probe_done", timings.get("train_done")), timings.get("save_done")),
    }
    return {key: end - begin for key, (begin, end) in spans.items() if begin is not None and end is not None}
