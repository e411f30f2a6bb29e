"""How measured step times relate to the raw model's: the calibration the decisions use (pure).

The model's step is ``max(host, matrix + memory + comm)`` (:class:`~cona.planner.step_parts.StepParts`). A
measured run corrects it in *shape*, each term by its own factor, because each prior misses by its own ratio
and the terms' shares change with the strategy and the model's size (one factor for the whole device fits one
size and misses the others: where the matrix rate is optimistic and the traffic time pessimistic, the error
grows with the model). Besides the profile's host dispatch the run may show host time the profile does not
have (a host-bound GPU dispatching eagerly; a CPU computing what it dispatches), fitted as ``host_step_s +
host_micro_batch_s * m`` with ``m`` the micro-batches per pipeline stage. Two forms:

* ``overlap``: ``max(host / host_efficiency + host_step_s + host_micro_batch_s * m, device)``: an
  asynchronous device, the host dispatching ahead of it (CUDA);
* ``serial``: ``max(host / host_efficiency, device + host_step_s + host_micro_batch_s * m)``: the extra host
  work and the device one after the other (a CPU doing both, or a step that synchronises),

with ``device = matrix / matrix_efficiency + memory / memory_efficiency + comm / comm_efficiency``. The one
whose fit misses least wins, among the forms the run allows (:func:`cona.planner.throughput.fitted_forms`: the
native engine on an accelerator never waits for the device inside a step, so overlap only). Both are fitted on
log step times with a weak pull of every parameter towards "the model is right" (factors 1, no extra host
time), so a term the points cannot identify (communication on one GPU, the host on device-bound steps) stays
at its neutral value instead of anywhere. Where the model's device with only the host terms fitted meets
every point within :data:`PRIOR_DEVICE_TOLERANCE`, that fit is taken: the pull alone is too weak to keep a
few percent between two host-bound points from moving the device. One measured point cannot tell a
host floor from a slow device: it corrects the term that bounds the model's step (the host floor or the
device; the host where the point is over a device-bound step by more than the device's prior misses and
the host floor is near it), or, under both, scales the whole step (``scale``); no point gives the raw
model.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
from scipy.optimize import least_squares

from cona.errors import PlanError
from cona.planner.step_parts import StepParts

Form = Literal["model", "scale", "overlap", "serial"]
PRIOR_WEIGHTS = (0.01, 0.1, 0.1, 0.01, 0.03, 0.01)
"""Pull towards 0, against a log error of 1 per measured strategy, of: the log of the device's overall
factor; the log of the ratios that set the matrix factor above and the memory factor below it (their
geometric mean is the overall factor) and the communication factor against it; the log of the host
factor; the extra host time per step and per micro-batch (both in units of the median measured step).
Weak on the overall level and the host, which the priors get least right and which two points can place;
ten times firmer on the ratios between the device's terms, which come from the same system file: a 10%
miss weighs as much as a ratio e off, so a few points with the terms in similar shares move the level, and
the split needs points whose shares differ (several model sizes, say). Host time that the points cannot
place goes mostly (9:1) to the micro-batches: an eager step's host work is the forward and backward
dispatch of each micro-batch, the optimizer's foreach kernels are few."""
EFFICIENCY_BOUNDS = (0.01, 100.0)
HOST_BOUND = 10.0
"""Most extra host time per step or micro-batch, in median measured steps."""
PRIOR_DEVICE_TOLERANCE = 0.05
"""Where the model's own device (its factors at 1, only the host terms fitted) meets every measured point
within this, that fit is taken: below a few percent the points cannot show a device factor (a strategy's
metrics lines scatter by about 5% on a shared machine). Fitted freely, two host-bound eager points whose step
times differ by 3-7% (gbs 8 and 16) make the device the bottleneck at gbs 16 and predict gbs 32 at half its
measured rate; with the model's device kept, within 10%. The price is on clean device-bound points the model
already meets within 5%: ``bench/planner_validation.py``'s leave-one-out fits miss by 1.48% on average (at
most 6.1%) instead of 0.71% (1.5%)."""
DEVICE_PRIOR_ERROR = 0.10
"""How far a card's own system file may miss a step's device time: GPT-125M's eager kernels take 7-8% less
than the H100 file's device time. Host floors miss by far more: host-bound
eager GPT-125M steps at gbs 8-16 take 29-61 ms across hosts, against one prior for all
(:data:`cona.planner.profiles.EAGER_HOST`)."""
DEVICE_PARAMS = 3
"""The first parameters of a fit are the device's (see :data:`PRIOR_WEIGHTS`), the rest the host's."""
LEAST_SQUARES = {"method": "dogbox"}
"""The solver's settings (``scipy.optimize.least_squares``), with the exact Jacobian: the same minima as
"trf" with a numerical one on these bounded six-variable fits, or lower, in 2-12x fewer
seconds."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StepShape:
    """How measured step seconds relate to the raw model's: see the module docstring."""

    form: Form = "model"
    matrix_efficiency: float = 1.0
    memory_efficiency: float = 1.0
    comm_efficiency: float = 1.0
    host_efficiency: float = 1.0
    host_step_s: float = 0.0
    host_micro_batch_s: float = 0.0
    error: float = float("nan")
    """Mean |predicted / measured - 1| over the measured strategies it was fitted on."""

    def step_s(self, parts: StepParts) -> np.ndarray:
        """Corrected step seconds of each strategy of ``parts``."""
        device = (
            parts.matrix_s / self.matrix_efficiency
            + parts.memory_s / self.memory_efficiency
            + parts.comm_s / self.comm_efficiency
        )
        dispatch = parts.host_s / self.host_efficiency
        extra = self.host_step_s + self.host_micro_batch_s * parts.micro_batches
        if self.form == "serial":
            return np.maximum(dispatch, device + extra)
        return np.maximum(dispatch + extra, device)

    def record(self) -> dict[str, float | str]:
        return {
            "form": self.form,
            "matrix_efficiency": self.matrix_efficiency,
            "memory_efficiency": self.memory_efficiency,
            "comm_efficiency": self.comm_efficiency,
            "host_efficiency": self.host_efficiency,
            "host_step_s": self.host_step_s,
            "host_micro_batch_s": self.host_micro_batch_s,
            "error": self.error,
        }

    def describe(self) -> str:
        """The fit in one line (for reports)."""
        return (
            f"{self.form}: matrix efficiency {self.matrix_efficiency:.3g}, memory "
            f"{self.memory_efficiency:.3g}, comm {self.comm_efficiency:.3g}, host "
            f"{self.host_efficiency:.3g}; extra host "
            f"{self.host_step_s * 1e3:.3g} ms per step + {self.host_micro_batch_s * 1e3:.3g} ms per "
            f"micro-batch; mean error {self.error:.1%}"
        )


FITTED_FORMS: tuple[Form, ...] = ("overlap", "serial")


def fit_shape(
    parts: StepParts, measured_s: np.ndarray | list[float], forms: tuple[Form, ...] = FITTED_FORMS
) -> StepShape:
    """The form (of ``forms``) and parameters that best map the model's step parts onto the measured
    seconds."""
    times = np.asarray(measured_s, dtype=float)
    if len(parts) != times.size:
        raise PlanError("fit_shape: model parts and measured step times differ in length")
    if times.size == 0:
        return StepShape()
    if not (np.all(times > 0) and np.all(parts.raw_step_s > 0)):
        raise PlanError("fit_shape: step times must be positive")
    if times.size == 1:
        shape = _one_point_shape(parts, float(times[0]), forms)
        return replace(shape, error=_error(shape, parts, times))
    fits = [_fit_form(form, parts, times, prior_device=True) for form in forms]
    best = min(fits, key=lambda fit: fit[1])[0]
    if np.max(np.abs(best.step_s(parts) / times - 1.0)) > PRIOR_DEVICE_TOLERANCE:
        fits = [_fit_form(form, parts, times) for form in forms]
        best = min(fits, key=lambda fit: fit[1])[0]
    return replace(best, error=_error(best, parts, times))


_FACTORS = ("matrix_efficiency", "memory_efficiency", "comm_efficiency", "host_efficiency")


def _one_point_shape(parts: StepParts, measured_s: float, forms: tuple[Form, ...]) -> StepShape:
    """One point corrects the term that bounds the model's step (its host floor or its device) where the
    other term stays under the measured step: nothing measured says that term was off, and a factor on
    it too would move every strategy it bounds; except that a device-bound step measured too far over its
    device with a host floor near it corrects the host (:func:`_host_explains`). Only where the measured
    step is under both terms does one factor scale the whole step. Two GPT-125M cases show why:

    * compiled (CUDA graphs), gbs 8 steps in 14.6 ms against a host floor of 16.6 ms and a device of
      11.4 ms; one factor on both makes gbs 16 16.9 ms, which measures 19.9 ms (the device's 19.3 ms);
    * eager, gbs 16 steps in 39.3 ms against a host floor of 29.8 ms and a device of 26.6 ms (a slow host);
      one factor makes gbs 32 63.2 ms, which measures 50.1 ms (the device's 48.0 ms): 0.79 of its rate.
    """
    host, device = float(parts.host_s[0]), float(parts.device_s[0])
    form: Form = "overlap" if "overlap" in forms else "serial"  # without extra host time both are the max
    if (host >= device and measured_s >= device) or _host_explains(host, device, measured_s):
        return StepShape(form=form, host_efficiency=host / measured_s)
    if device > host and measured_s >= host:
        factors = ("matrix_efficiency", "memory_efficiency", "comm_efficiency")
        return StepShape(form=form, **dict.fromkeys(factors, device / measured_s))
    factor = measured_s / float(parts.raw_step_s[0])
    return StepShape(form="scale", **dict.fromkeys(_FACTORS, 1.0 / factor))


def _host_explains(host: float, device: float, measured_s: float) -> bool:
    """Over a device-bound model step by more than the device's prior can miss, with a host floor within
    that of the device: the host, whose prior misses most, is what ran slow. Eager GPT-125M on an H100 with
    its own system file: gbs 16 steps in 39.9 ms over a device of 32.1 ms (its kernels take 29.9 ms) and a
    host floor of 29.8 ms. Corrected on the device, gbs 8 would keep the host floor, be predicted at 1.5-1.7x
    its measured rate, and a fall-back to it would look right where it does not pay."""
    slack = 1.0 - DEVICE_PRIOR_ERROR
    return device > host >= device * slack and measured_s * slack > device


def _fit_form(
    form: Form,
    parts: StepParts,
    times: np.ndarray,
    solver: dict | None = None,
    *,
    prior_device: bool = False,
) -> tuple[StepShape, float]:
    """Least squares from several starts: the max has a kink per point that a local fit does not cross.
    ``solver``: settings for ``least_squares`` in place of :data:`LEAST_SQUARES` (a benchmark's reference).
    ``prior_device``: the device's factors stay at 1 and only the host's terms are fitted."""
    scale = float(np.median(times))
    problem = _LogMisses(form, parts, times, scale, first_free=DEVICE_PARAMS if prior_device else 0)
    settings = {"jac": problem.jacobian, **(LEAST_SQUARES if solver is None else solver)}
    low, high = np.log(EFFICIENCY_BOUNDS)
    floor = float(np.min(times)) / scale / 2.0  # half per step, half per micro-batch
    per_micro_batch = floor / max(float(np.min(parts.micro_batches)), 1.0)
    device_starts = [0.0] if prior_device else np.linspace(np.log(0.03), np.log(3.0), 5)
    best = None
    # Extra host times start just inside their bound: least_squares does not move a variable that starts
    # on one. Device factors from 3% to 3x: an efficiency that makes a point device-bound must be started
    # near.
    for log_efficiency, host in itertools.product(device_starts, (1e-3, floor)):
        start = [log_efficiency, 0.0, 0.0, 0.0, host, per_micro_batch if host == floor else host]
        fit = least_squares(
            problem.residuals,
            x0=np.array(start[problem.first_free :]),
            bounds=(
                ([low] * 4 + [0.0, 0.0])[problem.first_free :],
                ([high] * 4 + [HOST_BOUND, HOST_BOUND])[problem.first_free :],
            ),
            **settings,
        )
        if best is None or fit.cost < best.cost:
            best = fit
    assert best is not None
    return problem.shape_of(best.x), float(best.cost)


def fit_cost(form: Form, parts: StepParts, times: np.ndarray, solver: dict | None = None) -> float:
    """The least-squares cost of the best fit of one form (``solver`` as in :func:`_fit_form`)."""
    return _fit_form(form, parts, np.asarray(times, dtype=float), solver)[1]


class _LogMisses:
    """The residuals of a fit (log misses of the measured steps, then the priors' pulls) and their exact
    Jacobian: the refit runs beside training at every new measured rate, and a numerical Jacobian made
    it seconds of CPU on the workers' cores (a decision 3-4 s after its line on a loaded 2-core CPU)."""

    def __init__(
        self, form: Form, parts: StepParts, times: np.ndarray, scale: float, first_free: int = 0
    ) -> None:
        self.form, self.parts, self.times, self.scale = form, parts, times, scale
        self.first_free = first_free
        """Parameters before this index stay 0 (their neutral value); the solver sees the others."""

    def _full(self, free: np.ndarray) -> np.ndarray:
        return np.concatenate([np.zeros(self.first_free), free])

    def shape_of(self, free: np.ndarray) -> StepShape:
        params = self._full(free)
        level, split, comm, host = np.exp(params[:4])
        return StepShape(
            form=self.form,
            matrix_efficiency=float(level * split),
            memory_efficiency=float(level / split),
            comm_efficiency=float(level * comm),
            host_efficiency=float(host),
            host_step_s=float(params[4]) * self.scale,
            host_micro_batch_s=float(params[5]) * self.scale,
        )

    def _terms(self, params: np.ndarray) -> tuple[np.ndarray, ...]:
        """Per point: the matrix, memory, comm and dispatch terms, the extra host time, and the step."""
        p, parts = params, self.parts
        matrix = parts.matrix_s * np.exp(-p[0] - p[1])
        memory = parts.memory_s * np.exp(-p[0] + p[1])
        comm = parts.comm_s * np.exp(-p[0] - p[2])
        dispatch = parts.host_s * np.exp(-p[3])
        extra = self.scale * (p[4] + p[5] * parts.micro_batches)
        device = matrix + memory + comm
        if self.form == "serial":
            step = np.maximum(dispatch, device + extra)
        else:
            step = np.maximum(dispatch + extra, device)
        return matrix, memory, comm, dispatch, extra, device, step

    def residuals(self, free: np.ndarray) -> np.ndarray:
        params = self._full(free)
        step = self._terms(params)[-1]
        pulls = np.multiply(PRIOR_WEIGHTS, params)[self.first_free :]
        return np.concatenate([np.log(step / self.times), pulls])

    def jacobian(self, free: np.ndarray) -> np.ndarray:
        matrix, memory, comm, dispatch, extra, device, step = self._terms(self._full(free))
        # Which side of the max each point is on (a tie takes the device's side, as np.maximum's value).
        serial = self.form == "serial"
        device_side = (device + extra >= dispatch) if serial else (device >= dispatch + extra)
        extra_counts = device_side if serial else ~device_side
        micro_batches = self.parts.micro_batches
        columns = [
            np.where(device_side, -device, 0.0),
            np.where(device_side, memory - matrix, 0.0),
            np.where(device_side, -comm, 0.0),
            np.where(device_side, 0.0, -dispatch),
            np.where(extra_counts, self.scale, 0.0),
            np.where(extra_counts, self.scale * micro_batches, 0.0),
        ]
        misses = np.stack(columns, axis=1) / step[:, None]
        pulls = np.diag(PRIOR_WEIGHTS)[self.first_free :]
        return np.vstack([misses, pulls])[:, self.first_free :]


def _error(shape: StepShape, parts: StepParts, times: np.ndarray) -> float:
    return float(np.mean(np.abs(shape.step_s(parts) / times - 1.0)))
