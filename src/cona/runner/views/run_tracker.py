"""CONA's own signals in the trackers: what the runner knows and the workers do not.

The workers' rank 0 sends loss, lr, perplexity, throughput and the layout of every log interval to
TensorBoard and W&B (:mod:`cona.engine.metrics`). The runner adds, per online decision, the noise scale the
decision used (and the measured one when a floor raised it), the statistical efficiency of the running and
the candidate batch size, and the predicted against the measured throughput; and one event per switch or
fall-back (a chain's step to its next strategy included).

TensorBoard: scalars ``cona/...`` and the text ``cona/events`` in the workers' directory
``<tensorboard_dir>/<run name>`` (a second event file, so TensorBoard shows both as one run). W&B: a run of
its own, ``<run name>-cona`` in the group ``<run name>`` (two processes must not write one W&B run), with
``iteration`` as its step and the events as the table ``cona/events``.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from cona.config import TrainingConfig
from cona.errors import ConfigError

DECISION_SCALARS: dict[str, tuple[str, ...]] = {
    "cona/noise_scale": ("noise_scale",),
    "cona/noise_scale_measured": ("measured_noise_scale",),
    "cona/noise_scale_ema": ("noise_scale_ema",),
    "cona/efficiency": ("current", "efficiency"),
    "cona/candidate_efficiency": ("candidate", "efficiency"),
    "cona/measured_tokens_per_s": ("current", "measured_tokens_per_s"),
    "cona/predicted_tokens_per_s": ("current_predicted_tokens_per_s",),
    "cona/predicted_over_measured": ("predicted_over_measured",),
    "cona/candidate_predicted_tokens_per_s": ("candidate", "predicted_tokens_per_s"),
    "cona/switch_cost_s": ("switch_cost_s",),
}
"""Tracker name -> path into a ``decisions.jsonl`` record (see :func:`cona.planner.policy.decide`)."""
EVENTS_TAG = "cona/events"
EVENT_COLUMNS = ["iteration", "stage", "action", "strategy", "reason"]


def wandb_notice(training: TrainingConfig, run_name: str) -> str:
    """The one line that says whether W&B is on, and why not when it is off."""
    mode, project = training.wandb_mode, training.wandb_project
    if project is None:
        alone = f" (training.wandb_mode {mode!r} alone does not turn it on)" if mode != "disabled" else ""
        return f"W&B is off: training.wandb_project is not set{alone}"
    if mode == "disabled":
        return f"W&B is off: training.wandb_mode is 'disabled' (training.wandb_project {project!r})"
    return (
        f"W&B: project {project}, mode {mode}; the workers log run {run_name}, CONA's decisions and switches "
        f"run {run_name}-cona (group {run_name})"
    )


def decision_scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of :data:`DECISION_SCALARS` in a decision record."""
    values = {}
    for name, path in DECISION_SCALARS.items():
        value: Any = record
        for key in path:
            value = value.get(key) if isinstance(value, Mapping) else None
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            values[name] = float(value)
    return values


class RunTracker:
    """The runner's TensorBoard writer and W&B run (either may be absent). Thread-safe: the online search
    logs its decisions from its own thread."""

    def __init__(self, *, tensorboard: Any = None, wandb_run: Any = None) -> None:
        self._tensorboard, self._wandb = tensorboard, wandb_run
        self._events: list[list[Any]] = []
        self._lock = threading.Lock()

    @classmethod
    def off(cls) -> RunTracker:
        """A tracker that records nothing (no tracker is configured, or in tests)."""
        return cls()

    @classmethod
    def open(cls, training: TrainingConfig, run_name: str, out: Callable[[str], None]) -> RunTracker:
        """The trackers the config asks for; says on ``out`` (once) whether W&B is on."""
        out(wandb_notice(training, run_name))
        tensorboard = wandb_run = None
        if training.tensorboard_dir is not None:
            tensorboard = _tensorboard_writer(Path(training.tensorboard_dir) / run_name)
        if training.wandb_project is not None and training.wandb_mode != "disabled":
            wandb_run = _wandb_run(training, run_name)
        return cls(tensorboard=tensorboard, wandb_run=wandb_run)

    def decision(self, record: Mapping[str, Any]) -> None:
        """One evaluation of the online search (a ``decisions.jsonl`` record)."""
        values = decision_scalars(record)
        if not values:
            return
        iteration = int(record["iteration"])
        with self._lock:
            if self._tensorboard is not None:
                for name, value in values.items():
                    self._tensorboard.add_scalar(name, value, global_step=iteration)
                self._tensorboard.flush()
            if self._wandb is not None:
                self._wandb.log({"iteration": iteration, **values})

    def switch(
        self, *, stage: int, iteration: int, action: str, strategy: str, reason: str, in_place: bool = False
    ) -> None:
        """Stage ``stage`` starts at ``iteration`` under ``strategy`` after a switch, a fall-back or a
        chain's next step (``action``)."""
        how = " in place" if in_place else ""
        text = f"stage {stage - 1} -> {stage}: {action}{how} to {strategy} at iteration {iteration}: {reason}"
        with self._lock:
            self._events.append([iteration, stage, action + how, strategy, reason])
            if self._tensorboard is not None:
                self._tensorboard.add_text(EVENTS_TAG, text, global_step=iteration)
                self._tensorboard.add_scalar("cona/stage", stage, global_step=iteration)
                self._tensorboard.flush()
            if self._wandb is not None:
                import wandb

                table = wandb.Table(columns=EVENT_COLUMNS, data=[list(row) for row in self._events])
                self._wandb.log({"iteration": iteration, "cona/stage": stage, EVENTS_TAG: table})

    def close(self) -> None:
        with self._lock:
            if self._tensorboard is not None:
                self._tensorboard.close()
            if self._wandb is not None:
                self._wandb.finish()
            self._tensorboard = self._wandb = None

    def __enter__(self) -> RunTracker:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()


def _tensorboard_writer(directory: Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError(
            "training.tensorboard_dir is set but tensorboard is not installed (pip install 'cona[tracking]')"
        ) from None
    # its own file name: the workers' writer of the same run writes the same directory
    return SummaryWriter(log_dir=str(directory), filename_suffix=".cona-runner")


def _wandb_run(training: TrainingConfig, run_name: str) -> Any:
    try:
        import wandb
    except ImportError:
        raise ConfigError(
            "training.wandb_project is set but wandb is not installed (pip install 'cona[tracking]')"
        ) from None
    if training.wandb_dir is not None:
        Path(training.wandb_dir).mkdir(parents=True, exist_ok=True)
    run_id = re.sub(r"[^A-Za-z0-9._-]", "-", run_name)[:59] + "-cona"  # the workers' id + "-cona"
    run = wandb.init(
        project=training.wandb_project,
        dir=training.wandb_dir,
        mode=training.wandb_mode,
        name=f"{run_name}-cona",
        id=run_id,
        group=run_name,
        job_type="cona-runner",
        resume="allow",
    )
    run.define_metric("iteration")
    run.define_metric("cona/*", step_metric="iteration")
    return run
