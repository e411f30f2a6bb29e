"""Throughput of a strategy as the decisions see it: measured where the run has it, else predicted by the
performance model corrected in *shape* on every measured point (pure).

A single factor anchored on the running strategy keeps the model's shape, and the shape is what is wrong at
small sizes on a GPU: the step is host-bound (Python and kernel launches), so its time barely grows with the
batch while the model's device time does (GPT-125M on an H200, issue 16: the model said 1.15x more tokens/s at
gbs 16 than at gbs 8, the GPU gave 2.3x). The correction fits the raw model's step time ``d`` of each measured
strategy, with ``m`` micro-batches per pipeline stage (``micro_batches / pp``: the host work of a micro-batch
is its stage's kernels), to one of two forms:

* ``overlap``: ``max(host_step_s + host_micro_batch_s * m, d / efficiency)``: an asynchronous device, the host
  dispatching ahead of it (CUDA);
* ``serial``: ``host_step_s + host_micro_batch_s * m + d / efficiency``: host and device work one after the
  other (a CPU doing both, or a step that synchronises).

The one whose fit misses least wins. Both are fitted on log step times with a weak pull of every parameter
towards "the model is right" (efficiency 1, no host time), so a term the points cannot identify stays at its
neutral value instead of anywhere. One measured point cannot tell a host floor from a slow device: it gives a
single factor (``scale``); no point gives the raw model.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np
from scipy.optimize import least_squares

from cona.config import ModelConfig
from cona.errors import PlanError
from cona.planner.flops import ModelShape
from cona.planner.perf_model import predict
from cona.planner.systems import System
from cona.strategy import Strategy, StrategyArray

Form = Literal["model", "scale", "overlap", "serial"]
PRIOR_WEIGHTS = (0.01, 0.03, 0.01)
"""Pull of log(efficiency), the host time per step and per micro-batch (both in units of the median measured
step) towards 0, against a log error of 1 per measured strategy: weak, only to settle what the points cannot
tell. Host time that the points cannot place goes mostly (9:1) to the micro-batches: an eager step's host work
is the forward and backward dispatch of each micro-batch, the optimizer's foreach kernels are few."""
EFFICIENCY_BOUNDS = (0.01, 100.0)
HOST_BOUND = 10.0
"""Most host time per step or micro-batch, in median measured steps."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StepShape:
    """How measured step seconds relate to the raw model's: see the module docstring."""

    form: Form = "model"
    efficiency: float = 1.0
    host_step_s: float = 0.0
    host_micro_batch_s: float = 0.0
    error: float = float("nan")
    """Mean |predicted / measured - 1| over the measured strategies it was fitted on."""

    def step_s(self, model_s: np.ndarray, micro_batches: np.ndarray) -> np.ndarray:
        device = np.asarray(model_s, dtype=float) / self.efficiency
        host = self.host_step_s + self.host_micro_batch_s * np.asarray(micro_batches, dtype=float)
        return np.maximum(host, device) if self.form == "overlap" else host + device

    def record(self) -> dict[str, float | str]:
        return {
            "form": self.form,
            "efficiency": self.efficiency,
            "host_step_s": self.host_step_s,
            "host_micro_batch_s": self.host_micro_batch_s,
            "error": self.error,
        }


def host_micro_batches(strategy: Strategy) -> float:
    """Micro-batches of host work per step on one rank, in whole-model units (a stage holds 1/pp of it)."""
    return strategy.micro_batches / strategy.pp


def fit_shape(
    model_s: Sequence[float], micro_batches: Sequence[float], measured_s: Sequence[float]
) -> StepShape:
    """The form and parameters that best map the model's step seconds onto the measured ones."""
    model, micro, times = (np.asarray(values, dtype=float) for values in (model_s, micro_batches, measured_s))
    if not (model.size == micro.size == times.size):
        raise PlanError("fit_shape: model, micro-batch and measured arrays differ in length")
    if times.size == 0:
        return StepShape()
    if not (np.all(times > 0) and np.all(model > 0)):
        raise PlanError("fit_shape: step times must be positive")
    if times.size == 1:
        shape = StepShape(form="scale", efficiency=float(model[0] / times[0]))
        return replace(shape, error=_error(shape, model, micro, times))
    fits = [_fit_form(form, model, micro, times) for form in ("overlap", "serial")]
    best = min(fits, key=lambda fit: fit[1])[0]
    return replace(best, error=_error(best, model, micro, times))


def _fit_form(form: Form, model: np.ndarray, micro: np.ndarray, times: np.ndarray) -> tuple[StepShape, float]:
    """Least squares from two starts (all device, all host): the overlap form's max has a kink between."""
    scale = float(np.median(times))

    def shape_of(params: np.ndarray) -> StepShape:
        return StepShape(
            form=form,
            efficiency=float(np.exp(params[0])),
            host_step_s=float(params[1]) * scale,
            host_micro_batch_s=float(params[2]) * scale,
        )

    def residuals(params: np.ndarray) -> np.ndarray:
        misses = np.log(shape_of(params).step_s(model, micro) / times)
        return np.concatenate([misses, np.multiply(PRIOR_WEIGHTS, params)])

    low, high = np.log(EFFICIENCY_BOUNDS)
    floor = float(np.min(times)) / scale / 2.0  # half per step, half per micro-batch
    best = None
    # Host times start just inside their bound: least_squares does not move a variable that starts on one.
    # Efficiencies from 3% to 3x: the overlap form's max has a kink per point that a local fit does not
    # cross, so an efficiency that makes a point device-bound must be started near.
    for log_efficiency, host in itertools.product(np.linspace(np.log(0.03), np.log(3.0), 5), (1e-3, floor)):
        start = [log_efficiency, host, host / max(float(np.min(micro)), 1.0)]
        fit = least_squares(
            residuals,
            x0=np.array(start),
            bounds=([low, 0.0, 0.0], [high, HOST_BOUND, HOST_BOUND]),
            diff_step=1e-4,
        )
        if best is None or fit.cost < best.cost:
            best = fit
    assert best is not None
    return shape_of(best.x), float(best.cost)


def _error(shape: StepShape, model: np.ndarray, micro: np.ndarray, times: np.ndarray) -> float:
    return float(np.mean(np.abs(shape.step_s(model, micro) / times - 1.0)))


@dataclass(frozen=True, kw_only=True, slots=True)
class Point:
    """One strategy's measured throughput over ``intervals`` log intervals, with the raw model's step time."""

    strategy: Strategy
    tokens_per_s: float
    model_step_s: float
    intervals: int = 1
    source: str = ""
    """Where it was measured (e.g. ``stage 2``): a new measurement from the same source replaces the old one,
    one from another source is kept beside it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Estimate:
    strategy: Strategy
    tokens_per_s: float
    source: Literal["measured", "predicted"]
    model_tokens_per_s: float
    """The raw model's throughput, for the record."""


@dataclass(frozen=True, kw_only=True)
class ThroughputEstimator:
    """Every measured point of a run and the shape fitted on them. :meth:`with_point` returns a refitted
    copy; :meth:`estimate` answers for any strategy given its raw model step time."""

    seq: int
    points: tuple[Point, ...] = ()
    shape: StepShape = field(default_factory=StepShape)

    def with_point(self, point: Point) -> ThroughputEstimator:
        return self.with_points([point])

    def with_points(self, new: Sequence[Point]) -> ThroughputEstimator:
        """A copy with ``new`` points added, refitted once."""
        points = self.points
        for point in new:
            if not point.tokens_per_s > 0 or not point.model_step_s > 0 or point.intervals < 1:
                raise PlanError(f"a measured point needs positive throughput and model time, got {point}")
            key = (point.strategy, point.source)
            points = (*(p for p in points if (p.strategy, p.source) != key), point)
        strategies = list(dict.fromkeys(p.strategy for p in points))
        rows = [
            (self._model_s(points, s), host_micro_batches(s), self._measured_s(points, s)) for s in strategies
        ]
        model_s, micro, measured_s = zip(*rows, strict=True)
        return replace(self, points=points, shape=fit_shape(model_s, micro, measured_s))

    def measured_tokens_per_s(self, strategy: Strategy) -> float | None:
        """Tokens over seconds of every interval the strategy was measured in (None: never measured)."""
        if not any(p.strategy == strategy for p in self.points):
            return None
        return strategy.gbs * self.seq / self._measured_s(self.points, strategy)

    def predicted_tokens_per_s(self, strategy: Strategy, model_step_s: float) -> float:
        step = self.shape.step_s(np.array([model_step_s]), np.array([host_micro_batches(strategy)]))
        return strategy.gbs * self.seq / float(step[0])

    def estimate(self, strategy: Strategy, model_step_s: float) -> Estimate:
        measured = self.measured_tokens_per_s(strategy)
        model_rate = strategy.gbs * self.seq / model_step_s
        if measured is not None:
            return Estimate(
                strategy=strategy, tokens_per_s=measured, source="measured", model_tokens_per_s=model_rate
            )
        predicted = self.predicted_tokens_per_s(strategy, model_step_s)
        return Estimate(
            strategy=strategy, tokens_per_s=predicted, source="predicted", model_tokens_per_s=model_rate
        )

    def ranked(self, strategies: Sequence[Strategy], model_step_s: Sequence[float]) -> list[Estimate]:
        """The strategies fastest first by :meth:`estimate` (stable: model order among equals)."""
        estimates = [self.estimate(s, float(t)) for s, t in zip(strategies, model_step_s, strict=True)]
        return sorted(estimates, key=lambda e: -e.tokens_per_s)

    def record(self) -> dict:
        """The fit for decisions.jsonl."""
        return {**self.shape.record(), "measured_strategies": len({p.strategy for p in self.points})}

    def _measured_s(self, points: Sequence[Point], strategy: Strategy) -> float:
        """Mean step seconds over the strategy's intervals (each point's median weighted by its intervals)."""
        own = [p for p in points if p.strategy == strategy]
        seconds = sum(p.intervals * strategy.gbs * self.seq / p.tokens_per_s for p in own)
        return seconds / sum(p.intervals for p in own)

    @staticmethod
    def _model_s(points: Sequence[Point], strategy: Strategy) -> float:
        return next(p.model_step_s for p in points if p.strategy == strategy)


def model_step_seconds(
    model: ModelConfig | ModelShape,
    strategies: Sequence[Strategy],
    system: System,
    dtype: str = "bf16",
    *,
    backend: str = "native",
) -> np.ndarray:
    """The raw (uncalibrated) model's device seconds per step of each strategy: what :class:`StepShape`
    corrects. The model's own host-dispatch floor is left out: the shape fits the host floor of the measured
    run itself (the prior's floor under it would only flatten what it fits)."""
    array = StrategyArray.from_strategies(list(strategies))
    prediction = predict(model, array, system, dtype=dtype, backend=backend)
    return prediction.iteration_time_s - prediction.host_bound_s


def estimator_from_step_times(
    measured: Sequence[tuple[Strategy, float]],
    model: ModelConfig | ModelShape,
    system: System,
    *,
    seq: int,
    dtype: str = "bf16",
    source: str = "trace",
    backend: str = "native",
) -> ThroughputEstimator:
    """An estimator from ``(strategy, measured step seconds)`` pairs (a trace's timed rows, say)."""
    estimator = ThroughputEstimator(seq=seq)
    if not measured:
        return estimator
    model_s = model_step_seconds(model, [s for s, _ in measured], system, dtype, backend=backend)
    points = [
        Point(
            strategy=strategy,
            tokens_per_s=strategy.gbs * seq / seconds,
            model_step_s=float(modelled),
            source=source,
        )
        for (strategy, seconds), modelled in zip(measured, model_s, strict=True)
    ]
    return estimator.with_points(points)
