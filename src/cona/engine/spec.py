"""The stage spec: everything one torchrun stage needs, written by the runner, read by every worker.

One JSON file per stage (``<run_dir>/stages/<N>/spec.json``). The config travels resolved (every path
absolute, vocab size derived), so a worker never re-discovers files and every rank sees the same values.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cona import run_files
from cona.atomic_files import write_json_atomic
from cona.config import ConaConfig, parse_config
from cona.errors import ConfigError, LaunchError
from cona.strategy import Strategy

SPEC_VERSION = 1
LAUNCH_TIME_ENV = "CONA_LAUNCH_TIME"
"""Environment variable in which the runner passes the unix time it started the stage's processes."""
RUNNER_PID_ENV = "CONA_RUNNER_PID"
"""The runner's pid: its workers stop (during training and between a session's stages) once it is gone."""
WORKER_CONSOLE_ENV = "CONA_WORKER_CONSOLE"
"""Set to 0 by the runner when its own console shows the metrics: rank 0 then prints no per-interval lines."""


@dataclass(frozen=True, kw_only=True)
class StageSpec:
    """One stage of a run: a fixed strategy trained from ``load_path`` (or scratch) until the stop rule."""

    run_dir: Path
    """The run directory; metrics.jsonl, stages/<stage>/ and switch requests live here."""
    config: ConaConfig
    """The resolved config (its ``path`` names the file it came from, for messages)."""
    strategy: Strategy
    stage: int
    """Stage number, counted from 1; names stages/<stage>/ and is written into every metrics line."""
    workdir: Path
    """Checkpoints go to ``<workdir>/checkpoints/<run_name>/<model>/z<zero>/<dtype>/<layout>/``
    (:func:`cona.engine.checkpoint.paths.layout_dir`)."""
    planned_tokens: int
    """Horizon of the LR schedule in tokens (used when training.lr_decay_tokens is not set)."""
    load_path: Path | None = None
    """Checkpoint to resume from (global_step dir, layout dir or universal dir); None starts from scratch."""
    target_iteration: int | None = None
    """Stop once this (absolute) iteration is done."""
    max_tokens: int | None = None
    """Stop once this many tokens (absolute, counted from the start of the run) are consumed."""
    lr_factor: float = 1.0
    """Peak LR = training.base_lr * lr_factor (the chain scales it when gbs changes)."""
    min_lr_factor: float = 1.0
    """Min LR = training.base_min_lr * min_lr_factor."""
    eval_interval: int | None = None
    """Iterations between evaluations; training.eval_interval when None."""
    eval_iters: int | None = None
    """Validation batches (of base_gbs samples) per evaluation; training.eval_iters when None."""
    save_at_end: bool = True
    """Save a checkpoint when the stop rule is met (a switch request always saves)."""
    save_interval: int | None = None
    """Also save every this many iterations (in the background, :mod:`cona.engine.checkpoint.periodic`)."""
    save_interval_minutes: float | None = None
    """Also save every this many minutes; with ``save_interval`` None too, only at the end and on a switch."""
    continue_in_place: bool = False
    """Take over the model, optimizer and data the session's previous stage left in memory (an in-place
    switch: only gbs, mbs and the LR change) instead of loading ``load_path``; refused unless the state in
    memory is at ``start_iteration``."""
    start_iteration: int | None = None
    """With ``continue_in_place``: the iteration the state in memory must be at."""
    hand_over_in_place: bool = False
    """At the stop rule, neither save nor drop the state: the session's next stage continues it in place
    (a chain step whose next step switches in place, or a stage retrained up to an in-place switch that a
    kill interrupted)."""
    warm_micro_batches: tuple[int, ...] = ()
    """Micro-batch sizes the session may switch to in place after this stage: a helper process compiles
    their graphs into the on-disk cache while the stage trains (:mod:`cona.engine.compile_warmup`)."""
    retraining: bool = False
    """A retraining that rebuilds the state an in-place switch kept in memory (after a kill): its result
    goes to its own file, and the stage's ``stage_result.json`` stays the stage's."""

    def __post_init__(self) -> None:
        if self.stage < 1:
            raise ConfigError(f"stage spec: stage must be >= 1, got {self.stage}")
        if self.target_iteration is None and self.max_tokens is None:
            raise ConfigError("stage spec: a stop rule is required (target_iteration and/or max_tokens)")
        if self.planned_tokens <= 0:
            raise ConfigError(f"stage spec: planned_tokens must be positive, got {self.planned_tokens}")
        for name in (
            "target_iteration",
            "max_tokens",
            "eval_interval",
            "eval_iters",
            "save_interval",
            "save_interval_minutes",
        ):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"stage spec: {name} must be positive, got {value}")

    @property
    def run_name(self) -> str:
        """The run directory's name: with the workdir, what names the run's checkpoint folders."""
        return self.run_dir.name

    @property
    def stage_dir(self) -> Path:
        return run_files.stage_path(self.run_dir, self.stage)

    @property
    def switch_in_path(self) -> Path:
        """Where rank 0 keeps the start milestones of the stage's first attempt (``timings`` of
        :class:`StageResult` up to ``first_step_done``)."""
        return self.stage_dir / run_files.SWITCH_IN

    @property
    def switch_request_path(self) -> Path:
        return run_files.switch_request_path(self.run_dir)

    @property
    def metrics_path(self) -> Path:
        return run_files.metrics_path(self.run_dir)

    @property
    def result_path(self) -> Path:
        return self.stage_dir / (run_files.REPLAY_RESULT if self.retraining else run_files.STAGE_RESULT)

    def resolved_eval_interval(self) -> int:
        """``eval_interval`` of the stage, else of the config, or its ``eval_every_tokens`` at this gbs."""
        training = self.config.training
        if self.eval_interval:
            return self.eval_interval
        if training.logging.eval_every_tokens:
            tokens_per_step = self.strategy.gbs * self.config.model.seq
            return max(1, round(training.logging.eval_every_tokens / tokens_per_step))
        return training.logging.eval_interval

    def resolved_eval_iters(self) -> int:
        return self.eval_iters or self.config.training.logging.eval_iters

    def to_dict(self) -> dict[str, Any]:
        values: dict[str, Any] = {"version": SPEC_VERSION}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, Path):
                value = str(value)
            elif isinstance(value, ConaConfig):
                value = {**value.to_dict(), "source": str(value.path) if value.path else None}
            elif isinstance(value, Strategy):
                value = dataclasses.asdict(value)
            values[field.name] = value
        return values

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> StageSpec:
        values = dict(raw)
        version = values.pop("version", None)
        if version != SPEC_VERSION:
            raise ConfigError(
                f"stage spec: version {version!r} is not {SPEC_VERSION}; rewrite it with this cona"
            )
        config_raw = dict(values.pop("config"))
        source = config_raw.pop("source", None)
        values["config"] = parse_config(config_raw, source=Path(source) if source else None)
        values["strategy"] = Strategy(**values["strategy"])
        for name in ("run_dir", "workdir", "load_path"):
            if values.get(name) is not None:
                values[name] = Path(values[name])
        values["warm_micro_batches"] = tuple(values.get("warm_micro_batches", ()))
        return cls(**values)

    def write(self, path: Path) -> Path:
        """Write the spec as JSON (atomically, so a reader never sees half a file)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        return write_json_atomic(path, self.to_dict())

    @classmethod
    def read(cls, path: Path) -> StageSpec:
        try:
            raw = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"stage spec {path} does not exist") from None
        except json.JSONDecodeError as err:
            raise ConfigError(f"stage spec {path}: not valid JSON: {err.msg} at line {err.lineno}") from None
        return cls.from_dict(raw)


STOP_REASONS = ("completed", "switch_requested", "switch_in_place")


@dataclass(frozen=True, kw_only=True)
class StageResult:
    """What a stage did, written by rank 0 to ``stages/<N>/stage_result.json`` after it saved."""

    stage: int
    reason: str
    """Why it stopped: ``completed`` (stop rule met), ``switch_requested`` (saved for the next stage) or
    ``switch_in_place`` (nothing saved: the session's next stage continues the state in memory)."""
    last_iteration: int
    consumed_samples: int
    consumed_tokens: int
    checkpoint: str | None
    """The global_step directory saved at the end, or None if this stage saved nothing at the end."""
    timings: dict[str, float]
    """Unix times: launch (the runner started torchrun), imports_start (the worker module began importing
    torch and CONA), process_start (the worker's imports done), model_done (model and optimizer built;
    stages built from scratch or a checkpoint), data_done (datasets and sample indices ready), load_done
    (built, data ready, checkpoint loaded; stages that load one), verify_done (its probe loss
    checked), setup_done, first_step_done, train_done, probe_done (the probe loss of the state to save
    measured), save_done."""
    switch_check: dict | None = None
    """The verdict of the loaded checkpoint's verification (:class:`cona.engine.switch_check.Verdict` as a
    dict); None when the stage started from scratch."""
    handed_over: bool = False
    """The stage's state stays in the session's memory for the next stage (no checkpoint at its end)."""

    def write(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        return write_json_atomic(path, dataclasses.asdict(self))

    @property
    def wall_s(self) -> float | None:
        return stage_wall_s(self.timings)

    @classmethod
    def read(cls, path: Path) -> StageResult:
        try:
            return cls(**json.loads(Path(path).read_text()))
        except FileNotFoundError:
            raise LaunchError(f"stage result {path} does not exist: the stage did not finish") from None
        except (json.JSONDecodeError, TypeError) as err:
            raise LaunchError(f"stage result {path} is not a stage result: {err}") from None


def stage_wall_s(timings: Mapping[str, Any]) -> float | None:
    """A stage's wall time (seconds), as the console's summary and the report give it: from its launch (the
    runner started it) to the end of its save, so its start-up, load and first step count (the switch into
    it); None when either time is not recorded."""
    launch, saved = timings.get("launch"), timings.get("save_done")
    if isinstance(launch, int | float) and isinstance(saved, int | float):
        return float(saved) - float(launch)
    return None
