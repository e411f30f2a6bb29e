"""The run's trackers on the runner's side: its W&B run, and CONA's own signals in TensorBoard.

W&B: one run per CONA run, written by the runner alone (two processes must not write one W&B run, and a
run's stages are processes of their own): it follows ``metrics.jsonl`` and logs the workers' ``train/...``
and ``eval/...`` scalars (:func:`cona.engine.metrics.scalars`), and adds CONA's signals. Its id is the run
name with a random suffix, kept in ``<run_dir>/wandb_run_id`` so that every resume of the run continues the
same W&B run and no other run (another directory's ``online`` say) ever shares it; ``--fresh`` makes a new
one. Its files go to ``training.wandb_dir``, else the run directory: one ``wandb/`` folder per run. The W&B
run is opened at its first value, so a run stopped before its first metrics line leaves none. Lines a
Megatron-DeepSpeed stage wrote (``backend`` set) are not forwarded: Megatron logs those in its own W&B run.

CONA's signals: per online decision, the noise scale the decision used (and the measured one when a floor
raised it), the statistical efficiency of the running and the candidate batch size, and the predicted
against the measured throughput; and one event per switch or fall-back (a chain's step to its next
strategy included). TensorBoard: scalars ``cona/...`` and the text ``cona/events`` in the workers' directory
``<tensorboard_dir>/<run name>`` (a second event file, so TensorBoard shows both as one run). W&B:
``iteration`` is every value's step; the events are the table ``cona/events``.
"""

from __future__ import annotations

import math
import re
import secrets
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from cona import run_files
from cona.atomic_files import write_atomic
from cona.config import ConaConfig, TrainingConfig
from cona.engine.metrics import scalars
from cona.errors import ConfigError
from cona.jsonl import JsonlTail

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
FOLLOW_INTERVAL_S = 1.0
"""How often the runner forwards new ``metrics.jsonl`` lines to W&B."""


def wandb_notice(
    training: TrainingConfig, run_name: str, run_id: str = "", directory: Path | None = None
) -> str:
    """The one line that says whether W&B is on (which run, where its files go), and why not when off."""
    mode, project = training.logging.wandb_mode, training.logging.wandb_project
    if project is None:
        alone = f" (training.wandb_mode {mode!r} alone does not turn it on)" if mode != "disabled" else ""
        return f"W&B is off: training.wandb_project is not set{alone}"
    if mode == "disabled":
        return f"W&B is off: training.wandb_mode is 'disabled' (training.wandb_project {project!r})"
    sync = f" (to sync: wandb sync {directory}/wandb/offline-run-*)" if mode == "offline" else ""
    return (
        f"W&B: project {project}, mode {mode}, run {run_name} (id {run_id}): the training curves and CONA's "
        f"decisions and switches; files in {directory}{sync}"
    )


def wandb_run_id(run_dir: Path) -> str:
    """The run's W&B id: read from ``<run_dir>/wandb_run_id``, made there (run name + random suffix, at most
    64 characters of ``[A-Za-z0-9._-]``) when the run has none yet."""
    path = Path(run_dir) / run_files.WANDB_RUN_ID
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    run_id = f"{re.sub(r'[^A-Za-z0-9._-]', '-', Path(run_dir).name)[:47]}-{secrets.token_hex(8)}"
    write_atomic(path, run_id + "\n")
    return run_id


def wandb_directory(training: TrainingConfig, run_dir: Path) -> Path:
    """Where the run's W&B files go (W&B adds ``wandb/`` below): ``training.wandb_dir``, else the run
    directory."""
    return Path(training.logging.wandb_dir) if training.logging.wandb_dir is not None else Path(run_dir)


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
    logs its decisions from its own thread, the W&B run's metrics come from a follower thread."""

    def __init__(
        self,
        *,
        tensorboard: Any = None,
        open_wandb: Callable[[], Any] | None = None,
        metrics_path: Path | None = None,
        out: Callable[[str], None] = print,
    ) -> None:
        self._tensorboard, self._open_wandb, self._wandb = tensorboard, open_wandb, None
        self._out = out
        self._events: list[list[Any]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._follower: threading.Thread | None = None
        if open_wandb is not None and metrics_path is not None:
            # what an earlier attempt of the run wrote, it forwarded itself
            tail = JsonlTail.at_end(metrics_path)
            self._follower = threading.Thread(target=self._follow, args=(tail,), daemon=True)
            self._follower.start()

    @classmethod
    def off(cls) -> RunTracker:
        """A tracker that records nothing (no tracker is configured, or in tests)."""
        return cls()

    @classmethod
    def open(cls, config: ConaConfig, run_dir: Path, out: Callable[[str], None]) -> RunTracker:
        """The trackers the config asks for; says on ``out`` (once) whether W&B is on."""
        training, run_name = config.training, Path(run_dir).name
        tensorboard = None
        if training.logging.tensorboard_dir is not None:
            tensorboard = _tensorboard_writer(Path(training.logging.tensorboard_dir) / run_name)
        if training.logging.wandb_project is None or training.logging.wandb_mode == "disabled":
            out(wandb_notice(training, run_name))
            return cls(tensorboard=tensorboard)
        _import_wandb()  # refused now, not at the first value
        run_id, directory = wandb_run_id(run_dir), wandb_directory(training, run_dir)
        out(wandb_notice(training, run_name, run_id, directory))

        def open_wandb() -> Any:
            return _wandb_run(config, run_name, run_id, directory)

        return cls(
            tensorboard=tensorboard,
            open_wandb=open_wandb,
            metrics_path=run_files.metrics_path(run_dir),
            out=out,
        )

    def _log_wandb(self, values: Mapping[str, Any]) -> None:
        """Log ``values`` to the W&B run, opening it at its first value (call holding the lock). W&B failing
        (no login in online mode, a full disk) stops W&B with one line; the training goes on."""
        if self._open_wandb is None:
            return
        try:
            if self._wandb is None:
                self._wandb = self._open_wandb()
            self._wandb.log(dict(values))
        except Exception as err:  # noqa: BLE001 (any W&B failure: the run must not die of its tracker)
            self._out(f"W&B stopped: {type(err).__name__}: {err}")
            self._open_wandb = None

    def _follow(self, tail: JsonlTail) -> None:
        while not self._stop.wait(FOLLOW_INTERVAL_S):
            self._forward(tail)
        self._forward(tail)  # what the last stage wrote before the run closed

    def _forward(self, tail: JsonlTail) -> None:
        for record in tail.new_records():
            values = scalars(record) if "backend" not in record and "iteration" in record else {}
            if values:
                with self._lock:
                    self._log_wandb({"iteration": int(record["iteration"]), **values})

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
            self._log_wandb({"iteration": iteration, **values})

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
            if self._open_wandb is not None:
                table = _import_wandb().Table(columns=EVENT_COLUMNS, data=[list(row) for row in self._events])
                self._log_wandb({"iteration": iteration, "cona/stage": stage, EVENTS_TAG: table})

    def close(self) -> None:
        if self._follower is not None:
            self._stop.set()
            self._follower.join()
            self._follower = None
        with self._lock:
            if self._tensorboard is not None:
                self._tensorboard.close()
            if self._wandb is not None:
                self._wandb.finish()
            self._tensorboard = self._wandb = self._open_wandb = None

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


def _import_wandb() -> Any:
    try:
        import wandb
    except ImportError:
        raise ConfigError(
            "training.wandb_project is set but wandb is not installed (pip install 'cona[tracking]')"
        ) from None
    return wandb


def _wandb_run(config: ConaConfig, run_name: str, run_id: str, directory: Path) -> Any:
    training = config.training
    directory.mkdir(parents=True, exist_ok=True)
    run = _import_wandb().init(
        project=training.logging.wandb_project,
        dir=str(directory),
        mode=training.logging.wandb_mode,
        name=run_name,
        id=run_id,
        resume="allow",
        config=config.to_dict(),
    )
    run.define_metric("iteration")
    for section in ("train", "eval", "cona"):
        run.define_metric(f"{section}/*", step_metric="iteration")
    return run
