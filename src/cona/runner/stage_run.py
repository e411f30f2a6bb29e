"""Launching one stage, as the chain runner and the online runner both do it.

A stage is handed to a :data:`Launcher` (torchrun in production, a fake engine in tests) as a
:class:`StageLaunch`. :func:`launch_stage` first cross-checks the checkpoint it loads against the run state
(:func:`check_trainer_state`), then starts it and turns a stage that stopped because it refused the
checkpoint it loaded (switch verification, :mod:`cona.engine.switch_check`) into one
:class:`~cona.errors.CheckpointError` that says so, instead of a worker failure; :func:`switch_check_line`
is the line that reports a stage's verification when it passed. Around the launch: the LR a stage plans
for its gbs (:func:`stage_lr`) and the timed publish of its checkpoint (:func:`publish_timed`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cona import run_files
from cona.atomic_files import write_json_atomic
from cona.config import TrainingConfig
from cona.engine.checkpoint.files import TRAINER_STATE_FILE
from cona.engine.checkpoint.info import read_checkpoint_info
from cona.engine.checkpoint.paths import layout_dir
from cona.engine.spec import StageSpec
from cona.engine.switch_check import VERDICT_FILE, Verdict, read_verdict
from cona.errors import CheckpointError, LaunchError
from cona.planner.lr_scaling import ScaledLR, scaled_lr
from cona.runner.launch import WORKER_MODULE, Topology, run_stage
from cona.runner.noise_history import measured_noise_scale
from cona.runner.run_lock import lock_directory, locking
from cona.runner.state import StageState, load_state, state_path


@dataclass(frozen=True, kw_only=True)
class StageLaunch:
    """One stage, ready to start: its spec (already written to ``spec_path``) and where it runs."""

    spec: StageSpec
    spec_path: Path
    topology: Topology
    device_type: str
    quiet: bool = False
    watch: Callable[[], None] | None = None
    """Called while the workers run (checks the other nodes); when it raises, the stage is stopped."""


Launcher = Callable[[StageLaunch], None]


def torchrun_launcher(
    launch: StageLaunch, *, worker_module: str = WORKER_MODULE, env: Mapping[str, str] | None = None
) -> None:
    """Start the stage's workers under a new torchrun and wait for them (``cona train --restart-workers``,
    and every stage of a run across nodes)."""
    run_stage(
        launch.spec_path,
        launch.spec.stage_dir,
        launch.topology,
        device_type=launch.device_type,
        quiet=launch.quiet,
        worker_module=worker_module,
        env=env,
        watch=launch.watch,
    )


def checkpoint_dtype(training: TrainingConfig, device_type: str) -> str:
    """The checkpoints' dtype directory: fp32 on CPU (which always trains in fp32), else the config's."""
    return "fp32" if device_type == "cpu" else training.runtime.dtype


def launch_stage(launcher: Launcher, launch: StageLaunch) -> float:
    """Run one attempt of a stage and wait for it; returns the unix time it was launched.

    Holds the run directory's and the checkpoint folder's locks (:mod:`cona.runner.run_lock`) within the
    run's scope. Raises :class:`CheckpointError` before the launch when the checkpoint to load disagrees
    with what the run state recorded for it (:func:`check_trainer_state`), and when the workers stopped
    because the checkpoint they loaded failed switch verification (its verdict, written by rank 0 before
    every rank stopped, says so), so the run ends with that message and not with a worker's traceback.
    """
    spec = launch.spec
    if locking():  # within a run's scope (the run directory is held already: no-op)
        lock_directory(spec.run_dir, "run directory")
        dtype = checkpoint_dtype(spec.config.training, launch.device_type)
        layout = layout_dir(spec.workdir, spec.config, spec.strategy, dtype, run_name=spec.run_name)
        lock_directory(layout, "checkpoint folder")
    check_trainer_state(spec.run_dir, spec.load_path)
    stage_dir = spec.stage_dir
    (stage_dir / VERDICT_FILE).unlink(missing_ok=True)  # an earlier attempt's verdict is not this one's
    launched = time.time()
    try:
        launcher(launch)
    except LaunchError:
        verdict = read_verdict(stage_dir)
        if verdict is not None and not verdict.passed:
            raise CheckpointError(refusal_message(spec.stage, verdict)) from None
        raise
    return launched


def check_trainer_state(run_dir: Path, load_path: Path | None) -> None:
    """Refuse to load a checkpoint the run recorded (a finished stage's ``checkpoint`` or ``universal``)
    whose ``trainer_state.json`` disagrees with the record: iteration, consumed samples or tokens changed
    after the save would train samples twice or skip them. Checkpoints the state does not record, and those
    of another backend's format, are left to the workers' own checks."""
    state = load_state(run_dir) if load_path is not None else None
    if state is None:
        return
    try:
        info = read_checkpoint_info(load_path)
    except CheckpointError:
        return
    for stage in state.stages:
        recorded = [Path(path) for path in (stage.checkpoint, stage.universal) if path]
        if stage.consumed_samples is None or not any(_same_directory(info.path, p) for p in recorded):
            continue
        expected = {
            "iteration": stage.last_iteration,
            "consumed_samples": stage.consumed_samples,
            "consumed_tokens": stage.consumed_tokens,
        }
        for key, value in expected.items():
            if value is not None and info.trainer_state.get(key) != value:
                raise CheckpointError(
                    f"{info.path / TRAINER_STATE_FILE}: {key} is {info.trainer_state.get(key)}, but the run "
                    f"state {state_path(run_dir)} records {value} for stage {stage.step_num}'s checkpoint; "
                    "refusing it"
                )


def _same_directory(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def refusal_message(stage: int, verdict: Verdict) -> str:
    """Why the run stopped at ``stage``, what was kept, and what a rerun does."""
    return (
        f"stage {stage}: {verdict.message()}. The run stops before stage {stage} trains; the checkpoint "
        f"stays published as the stage before left it. Rerunning the same command verifies it again "
        f"(and refuses it again until it is repaired or replaced)"
    )


def switch_check_line(stage: StageState) -> str | None:
    """``stage N: switch check passed: ...; probe X s + verify Y s`` for a stage that loaded a checkpoint
    (its costs: the probe before the previous stage's save is on the previous stage's books)."""
    if stage.switch_check is None:
        return None
    verdict = Verdict.from_dict(stage.switch_check)
    seconds = stage.timings.get("verify_s")
    cost = f" (verified in {seconds:.2f} s)" if seconds is not None else ""
    return f"stage {stage.step_num}: {verdict.message()}{cost}"


@dataclass(frozen=True, kw_only=True)
class StageLR:
    """The LR a stage trains with, fixed when it is planned."""

    scaled: ScaledLR
    lr_factor: float
    """Peak LR / training.base_lr."""
    min_lr_factor: float
    """Min LR / training.base_min_lr (the scaler's own factor when base_min_lr is 0)."""


def stage_lr(run_dir: Path, training: TrainingConfig, gbs: int, start_iteration: int) -> StageLR:
    """The LR of a stage at ``gbs`` (``training.lr_scale_strategy``; adascale from the noise scale measured
    in ``run_dir`` up to the stage's start)."""
    noise = (
        measured_noise_scale(run_dir, training, start_iteration)
        if training.lr.lr_scale_strategy == "adascale"
        else None
    )
    lr = scaled_lr(training, gbs, noise_scale=noise)
    min_lr_factor = lr.min_lr / training.lr.base_min_lr if training.lr.base_min_lr > 0 else lr.min_lr_factor
    return StageLR(scaled=lr, lr_factor=lr.lr / training.lr.base_lr, min_lr_factor=min_lr_factor)


def publish_timed(
    publisher: Callable[[Path], Path], stage: StageState, out: Callable[[str], None]
) -> dict[str, Any]:
    """Publish the stage's checkpoint; returns the stage's changes (its universal copy, and publish_s)."""
    began = time.perf_counter()
    universal = publisher(Path(stage.checkpoint))
    seconds = time.perf_counter() - began
    out(f"stage {stage.step_num}: published {universal} ({seconds:.2f} s)")
    return {"universal": str(universal), "timings": {**stage.timings, "publish_s": seconds}}


def write_plan(run_dir: Path, step_num: int, plan: dict[str, Any]) -> float:
    """Record the stage's plan in ``stages/<N>/plan.json``; returns its modification time, which dates the
    plan (a checkpoint or result not newer than it is not the stage's own)."""
    path = run_files.stage_plan_path(run_dir, step_num)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_json_atomic(path, plan).stat().st_mtime
