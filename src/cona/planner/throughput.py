"""Throughput of a strategy as the decisions see it: measured where the run has it, else predicted by the
performance model corrected in *shape* on every measured point (pure).

A single factor anchored on the running strategy keeps the model's shape, and the shape is what is wrong: at
small sizes on a GPU the step is host-bound (Python and kernel launches), so its time barely grows with the
batch while the model's device time does (GPT-125M on an H200: the model says 1.15x more tokens/s at gbs 16
than at gbs 8, the GPU gives 2.3x), and the device's terms miss by different ratios whose shares change with
the strategy. The correction (:mod:`cona.planner.step_shape`) scales each of the model's terms
(:mod:`cona.planner.step_parts`) by its own factor and adds the host time the run shows; the same code
calibrates ``cona plan`` on a trace and the validation in ``bench/planner_validation.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np

from cona.config import ModelConfig
from cona.errors import PlanError
from cona.planner.flops import ModelShape
from cona.planner.profiles import BackendProfile, backend_profile
from cona.planner.step_parts import StepParts, host_micro_batches, model_step_parts
from cona.planner.step_shape import FITTED_FORMS, Form, StepShape, fit_shape
from cona.planner.systems import System
from cona.strategy import Strategy

__all__ = [
    "Estimate",
    "Point",
    "StepParts",
    "StepShape",
    "ThroughputEstimator",
    "estimator_from_step_times",
    "fit_shape",
    "fitted_forms",
    "host_micro_batches",
    "model_step_parts",
    "model_step_seconds",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class Point:
    """One strategy's measured throughput over ``intervals`` log intervals, with the raw model's step."""

    strategy: Strategy
    tokens_per_s: float
    model: StepParts
    """The raw model's step of the strategy in parts (one row)."""
    intervals: int = 1
    source: str = ""
    """Where it was measured (e.g. ``stage 2``): a new measurement from the same source replaces the old one,
    one from another source is kept beside it."""
    proxy: bool = False
    """A stand-in for a measurement: steps of ``strategy`` before its steady rate (the run's first line after
    its first step, :meth:`cona.runner.schedules.frontier.FrontierSearch.add_first_line`). It enters the fit
    until the run has a measured point, then it is dropped, and it never answers for ``strategy`` as
    measured (a switch waits for a measured rate; a probe measures both)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Estimate:
    strategy: Strategy
    tokens_per_s: float
    source: Literal["measured", "predicted"]
    model_tokens_per_s: float
    """The raw model's throughput, for the record."""
    fitted_on: int = 0
    """Predicted: the measured strategies the shape was fitted on (one fixes only a scale, not a shape);
    proxy points are not counted."""
    on_first_line: bool = False
    """Predicted by a shape fitted only on proxy points (the run's first line, :attr:`Point.proxy`)."""


@dataclass(frozen=True, kw_only=True)
class ThroughputEstimator:
    """Every measured point of a run and the shape fitted on them. :meth:`with_point` returns a refitted
    copy; :meth:`estimate` answers for any strategy given its raw model step in parts."""

    seq: int
    points: tuple[Point, ...] = ()
    shape: StepShape = field(default_factory=StepShape)
    forms: tuple[Form, ...] = FITTED_FORMS
    """The step forms the fit may choose (:func:`fitted_forms`)."""

    def with_point(self, point: Point) -> ThroughputEstimator:
        return self.with_points([point])

    def with_points(self, new: Sequence[Point]) -> ThroughputEstimator:
        """A copy with ``new`` points added, refitted once."""
        points = self.points
        for point in new:
            model_s = point.model.raw_step_s
            one_positive = model_s.shape == (1,) and model_s[0] > 0
            if not point.tokens_per_s > 0 or not one_positive or point.intervals < 1:
                raise PlanError(f"a measured point needs positive throughput and model time, got {point}")
            key = (point.strategy, point.source)
            points = (*(p for p in points if (p.strategy, p.source) != key), point)
        if any(not p.proxy for p in points):
            points = tuple(p for p in points if not p.proxy)
        if not points:
            return self  # nothing measured: the raw model
        strategies = list(dict.fromkeys(p.strategy for p in points))
        parts = StepParts.concat([self._model(points, s) for s in strategies])
        measured_s = [self._measured_s(points, s) for s in strategies]
        return replace(self, points=points, shape=fit_shape(parts, measured_s, self.forms))

    def measured_tokens_per_s(self, strategy: Strategy) -> float | None:
        """Tokens over seconds of every interval the strategy was measured in (None: never measured)."""
        own = [p for p in self.points if not p.proxy]
        if not any(p.strategy == strategy for p in own):
            return None
        return strategy.gbs * self.seq / self._measured_s(own, strategy)

    def predicted_tokens_per_s(self, strategy: Strategy, model: StepParts) -> float:
        """The corrected model's throughput of ``strategy`` (``model``: its raw step in parts, one row)."""
        step = self.shape.step_s(model)
        return strategy.gbs * self.seq / float(step[0])

    def estimate(self, strategy: Strategy, model: StepParts) -> Estimate:
        measured = self.measured_tokens_per_s(strategy)
        model_rate = strategy.gbs * self.seq / float(model.raw_step_s[0])
        if measured is not None:
            return Estimate(
                strategy=strategy, tokens_per_s=measured, source="measured", model_tokens_per_s=model_rate
            )
        predicted = self.predicted_tokens_per_s(strategy, model)
        return Estimate(
            strategy=strategy,
            tokens_per_s=predicted,
            source="predicted",
            model_tokens_per_s=model_rate,
            fitted_on=len({p.strategy for p in self.points if not p.proxy}),
            on_first_line=bool(self.points) and not self.has_own_measurement,
        )

    def ranked(self, strategies: Sequence[Strategy], models: StepParts) -> list[Estimate]:
        """The strategies fastest first by :meth:`estimate` (stable: model order among equals); ``models``:
        their raw steps in parts, a row each."""
        if len(models) != len(strategies):
            raise PlanError("ranked: strategies and model parts differ in length")
        estimates = [self.estimate(s, models.take(row)) for row, s in enumerate(strategies)]
        return sorted(estimates, key=lambda e: -e.tokens_per_s)

    def record(self) -> dict:
        """The fit for decisions.jsonl."""
        own = {p.strategy for p in self.points if not p.proxy}
        record = {**self.shape.record(), "measured_strategies": len(own)}
        proxies = [p.source for p in self.points if p.proxy]
        return record | ({"proxy_points": proxies} if proxies else {})

    @property
    def has_own_measurement(self) -> bool:
        """Whether any point measured a strategy's own steps (not a proxy's)."""
        return any(not p.proxy for p in self.points)

    def _measured_s(self, points: Sequence[Point], strategy: Strategy) -> float:
        """Mean step seconds over the strategy's intervals (each point's median weighted by its intervals)."""
        own = [p for p in points if p.strategy == strategy]
        seconds = sum(p.intervals * strategy.gbs * self.seq / p.tokens_per_s for p in own)
        return seconds / sum(p.intervals for p in own)

    @staticmethod
    def _model(points: Sequence[Point], strategy: Strategy) -> StepParts:
        return next(p.model for p in points if p.strategy == strategy)


def fitted_forms(system: System, backend: BackendProfile) -> tuple[Form, ...]:
    """The step forms a run's measurements may be fitted with. The native engine on an accelerator never
    waits for the device inside a step (the loss and norms stay there until a metrics line), so its step
    is the overlap of host and device. The serial form would read a host floor as device work done after
    it: fitted on three eager host-bound points (gbs 8-32) it puts the device at 2.9x its kernels' speed
    plus 34 ms per step and predicts gbs 64 at 1.41x its measured rate. Other backends, and CPUs,
    may run host and device one after the other."""
    if system.asynchronous_dispatch and backend.name == "native":
        return ("overlap",)
    return FITTED_FORMS


def model_step_seconds(
    model: ModelConfig | ModelShape,
    strategies: Sequence[Strategy],
    system: System,
    dtype: str = "bf16",
    *,
    backend: str | BackendProfile = "native",
) -> np.ndarray:
    """The raw (uncalibrated) model's device seconds per step of each strategy (host dispatch left out)."""
    return model_step_parts(model, strategies, system, dtype, backend=backend).device_s


def estimator_from_step_times(
    measured: Sequence[tuple[Strategy, float]],
    model: ModelConfig | ModelShape,
    system: System,
    *,
    seq: int,
    dtype: str = "bf16",
    source: str = "trace",
    backend: str | BackendProfile = "native",
) -> ThroughputEstimator:
    """An estimator from ``(strategy, measured step seconds)`` pairs (a trace's timed rows, say)."""
    profile = backend_profile(backend) if isinstance(backend, str) else backend
    estimator = ThroughputEstimator(seq=seq, forms=fitted_forms(system, profile))
    if not measured:
        return estimator
    parts = model_step_parts(model, [s for s, _ in measured], system, dtype, backend=backend)
    points = [
        Point(
            strategy=strategy,
            tokens_per_s=strategy.gbs * seq / seconds,
            model=parts.take(row),
            source=source,
        )
        for row, (strategy, seconds) in enumerate(measured)
    ]
    return estimator.with_points(points)
