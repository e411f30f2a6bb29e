"""A recorded training trace for the offline planner: the noise scale and the loss over consumed tokens.

:func:`read_trace` reads a run's ``metrics.jsonl`` (or a run directory holding one): the ``gns_*`` fields go
through :class:`cona.planner.efficiency.NoiseScaleTracker` exactly as the online runner feeds it, so the
planner sees the same (smoothed, sometimes unknown) noise scale the runner would have; the timed rows give
the measured step times that calibrate the performance model; the gaps at stage changes give measured switch
costs. :func:`synthetic_trace` builds a trace of the shape the references describe instead (loss falling as a
power of the tokens, noise scale growing as a power of the loss decrease, Kaplan et al. 2020).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cona import run_files
from cona.config import TrainingConfig
from cona.errors import PlanError, not_found
from cona.jsonl import read_lines
from cona.metrics_record import MetricsRecord
from cona.planner.calibration import measurements_from_metrics
from cona.planner.efficiency import MIN_SAMPLES, NoiseScaleEstimate, NoiseScaleTracker
from cona.planner.probe_rule import ProbeOutcome
from cona.strategy import Strategy

METRICS_NAME = run_files.METRICS
KAPLAN_B_STAR_TOKENS = 2e8
"""Kaplan et al. 2020: critical batch ``B_crit(L) = B* / L^(1/alpha_B)`` with ``B* ~ 2e8`` tokens."""
KAPLAN_ALPHA_B = 0.21


@dataclass(frozen=True, kw_only=True)
class Trace:
    """Noise-scale measurements and losses of one run, indexed by consumed tokens (all arrays ascending)."""

    tokens: np.ndarray
    """Consumed tokens after each noise-scale measurement."""
    gbs: np.ndarray
    """Global batch (samples) of the step measured."""
    grad_sqr: np.ndarray
    """The tracker's smoothed ``|G|^2`` after each measurement."""
    trace_sigma: np.ndarray
    """The tracker's smoothed ``tr(Sigma)``."""
    samples: np.ndarray
    """Measurements in the tracker (0 before the first)."""
    loss_tokens: np.ndarray
    loss: np.ndarray
    loss_kind: str
    """``eval_loss`` when the run evaluated, else the training ``loss``."""
    timed: tuple[tuple[Strategy, float], ...] = ()
    """(strategy, median step seconds) pairs for calibration."""
    switch_costs_s: tuple[float, ...] = ()
    """Measured costs of the stage changes in the trace."""
    world_size: int | None = None
    backend: str = "native"
    """The backend that trained the run (its rows' ``backend`` field; the native engine writes none)."""
    probes: tuple[ProbeOutcome, ...] = ()
    """The paired probes the run made (``probes.jsonl`` beside its metrics), oldest first."""
    source: str = "<trace>"

    def estimate(self, index: int) -> NoiseScaleEstimate | None:
        """The tracker's estimate after measurement ``index`` (None while it has none)."""
        if self.samples[index] <= 0:
            return None
        return NoiseScaleEstimate(
            grad_sqr=float(self.grad_sqr[index]),
            trace_sigma=float(self.trace_sigma[index]),
            samples=int(self.samples[index]),
        )

    def tokens_at_loss(self, target: float) -> float:
        """Consumed tokens when the loss first reached ``target``; PlanError if it never did."""
        reached = np.flatnonzero(self.loss <= target)
        if reached.size == 0:
            best = float(np.min(self.loss)) if self.loss.size else math.nan
            raise PlanError(
                f"{self.source}: the trace's {self.loss_kind} never reaches the target {target:.4g} "
                f"(lowest {best:.4g}); choose a higher --target-loss / --target-ppl"
            )
        return float(self.loss_tokens[reached[0]])


def read_trace(path: str | Path, *, training: TrainingConfig, min_samples: int = MIN_SAMPLES) -> Trace:
    """Read ``metrics.jsonl`` (or ``<run dir>/metrics.jsonl``); ``training`` gives base_gbs and options."""
    path = Path(path)
    metrics = path / METRICS_NAME if path.is_dir() else path
    rows = _read_rows(metrics)
    tracker = NoiseScaleTracker(base_batch=training.lr.base_gbs, min_samples=min_samples)
    columns: dict[str, list[float]] = {
        key: [] for key in ("tokens", "gbs", "grad_sqr", "trace_sigma", "samples")
    }
    for number, row in rows:
        updated = tracker.update_from_metrics(row)
        if updated is tracker:
            continue
        tracker = updated
        columns["tokens"].append(_number(row, "consumed_tokens", metrics, number))
        columns["gbs"].append(_number(row, "gbs", metrics, number))
        estimate = tracker.estimate()  # None below min_samples: kept as samples = 0
        columns["grad_sqr"].append(math.nan if estimate is None else estimate.grad_sqr)
        columns["trace_sigma"].append(math.nan if estimate is None else estimate.trace_sigma)
        columns["samples"].append(0 if estimate is None else estimate.samples)
    if not columns["tokens"]:
        raise PlanError(
            f"{metrics}: no row has all of gns_small_sqr, gns_big_sqr, gns_small_batch, gns_big_batch"
        )
    loss_kind, loss_tokens, loss = _losses(rows, metrics)
    plain = [row for _, row in rows]
    timed = tuple(measurements_from_metrics(plain, training=training))
    first = next((row for row in plain if row.has_strategy), None)
    return Trace(
        **{key: np.asarray(values, dtype=np.float64) for key, values in columns.items()},
        loss_tokens=loss_tokens,
        loss=loss,
        loss_kind=loss_kind,
        timed=timed,
        switch_costs_s=_switch_costs(plain),
        world_size=None if first is None else int(first.dp) * int(first.tp) * int(first.pp),
        backend=next((row.backend for row in plain if row.backend), "native"),
        probes=_read_probes(metrics.parent / run_files.PROBES),
        source=str(metrics),
    )


def _read_probes(path: Path) -> tuple[ProbeOutcome, ...]:
    """The probes a run recorded (none where the file is missing); a probe the workers skipped is left out."""
    outcomes = []
    for line in read_lines(path):
        if line.error is not None or not isinstance(line.value, dict):
            raise PlanError(f"{path}: line {line.number} is not a JSON object")
        if "skipped" in line.value:
            continue
        try:
            outcomes.append(ProbeOutcome.from_dict(line.value))
        except (KeyError, TypeError) as err:
            raise PlanError(f"{path}: line {line.number} is not a probe record ({err})") from None
    return tuple(outcomes)


def _read_rows(path: Path) -> list[tuple[int, MetricsRecord]]:
    if not path.is_file():
        raise PlanError(f"--trace: {path} {not_found(path)} (give a run directory or its metrics.jsonl)")
    rows = []
    for line in read_lines(path):
        if line.error is not None:
            raise PlanError(f"{path}: line {line.number}: not valid JSON: {line.error.msg}")
        if isinstance(line.value, dict):
            try:
                rows.append((line.number, MetricsRecord.from_dict(line.value)))
            except ValueError as err:
                raise PlanError(f"{path}: line {line.number}: {err}") from None
    return rows


def _number(row: MetricsRecord, key: str, path: Path, number: int) -> float:
    value = getattr(row, key)
    if value is None:
        raise PlanError(f"{path}: line {number}: a row with gns fields needs a numeric '{key}'")
    return float(value)


def _losses(rows: list[tuple[int, MetricsRecord]], path: Path) -> tuple[str, np.ndarray, np.ndarray]:
    """The eval losses when the run has any, else the training losses, against consumed tokens."""
    for kind in ("eval_loss", "loss"):
        points = [
            (float(row.consumed_tokens), float(getattr(row, kind)))
            for _, row in rows
            if getattr(row, kind) is not None and row.consumed_tokens is not None
        ]
        if points:
            tokens, losses = zip(*points, strict=True)
            return kind, np.asarray(tokens), np.asarray(losses)
    raise PlanError(f"{path}: no row has a loss or eval_loss with consumed_tokens")


def _switch_costs(rows: list[MetricsRecord]) -> tuple[float, ...]:
    """Seconds lost at each stage change: the wall-clock gap between the last row of a stage and the first of
    the next, less the steps trained in between (at the new stage's median step time)."""
    timed = [row for row in rows if row.time is not None and row.iteration is not None]
    step_times: dict[int | None, list[float]] = {}
    for row in timed:
        if row.step_time_s is not None:
            step_times.setdefault(row.stage, []).append(float(row.step_time_s))
    costs = []
    for before, after in zip(timed, timed[1:], strict=False):
        if before.stage is None or before.stage == after.stage:
            continue
        step = statistics.median(step_times.get(after.stage, [0.0]))
        gap = float(after.time) - float(before.time)
        costs.append(max(gap - (float(after.iteration) - float(before.iteration)) * step, 0.0))
    return tuple(costs)


def kaplan_noise_scale(loss: np.ndarray | float, seq: int) -> np.ndarray:
    """Noise scale in samples of ``seq`` tokens at a loss (nats): ``B* / L^(1/alpha_B)`` tokens / seq."""
    return KAPLAN_B_STAR_TOKENS / np.power(np.asarray(loss, dtype=np.float64), 1.0 / KAPLAN_ALPHA_B) / seq


@dataclass(frozen=True, kw_only=True, slots=True)
class LossCurve:
    """``L(D) = floor + (start - floor) / (1 + D / scale_tokens) ** exponent`` at the base batch."""

    start: float = 10.8
    """Loss at initialisation (ln of a GPT-2-sized vocabulary)."""
    floor: float = 2.0
    scale_tokens: float = 2e7
    exponent: float = 0.5

    def __call__(self, tokens: np.ndarray) -> np.ndarray:
        return self.floor + (self.start - self.floor) / np.power(
            1.0 + tokens / self.scale_tokens, self.exponent
        )


def synthetic_trace(
    *,
    seq: int,
    gbs: int,
    total_tokens: float,
    points: int = 2000,
    curve: LossCurve | None = None,
    noise_multiplier: float = 1.0,
    unknown_points: int = 10,
) -> Trace:
    """A trace recorded at ``gbs`` = the base batch: loss on ``curve``, noise scale from Kaplan's law.

    ``noise_multiplier`` scales the noise scale (the constants are rough; Adam's is larger than SGD's). The
    first ``unknown_points`` measurements report no estimate, as the tracker does before it has enough.
    """
    curve = curve or LossCurve()
    tokens = np.linspace(total_tokens / points, total_tokens, points)
    loss = curve(tokens)
    samples = np.arange(1, points + 1, dtype=np.float64)
    samples[:unknown_points] = 0
    return Trace(
        tokens=tokens,
        gbs=np.full(points, float(gbs)),
        grad_sqr=np.ones(points),
        trace_sigma=noise_multiplier * kaplan_noise_scale(loss, seq),
        samples=samples,
        loss_tokens=tokens,
        loss=loss,
        loss_kind="loss",
        source="synthetic",
    )
