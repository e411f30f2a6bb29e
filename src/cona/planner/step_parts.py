"""The model's step split into the terms a calibration corrects each by its own factor (pure numpy).

The performance model adds matrix arithmetic, memory traffic and exposed communication into the device's
time and takes the larger of it and the host's dispatch (:mod:`cona.planner.perf_model`). Their priors miss
by different ratios (a GPU's matrix rate can be optimistic while its traffic time is pessimistic), and their
shares of a step change with the model's size, the micro-batch and the layout, so a correction fitted on
measured steps scales each term apart (:mod:`cona.planner.step_shape`). The split is the model's own: a
factor of infinity in :class:`~cona.planner.calibration_factors.Calibration` removes a term, so each part
is exactly what that factor divides inside :func:`~cona.planner.perf_model.predict`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np

from cona.config import ModelConfig
from cona.planner.calibration_factors import Calibration
from cona.planner.flops import ModelShape
from cona.planner.perf_model import predict
from cona.planner.profiles import BackendProfile
from cona.planner.systems import System
from cona.strategy import Strategy, StrategyArray

WITHOUT_MATRIX = Calibration(matrix_efficiency=math.inf, comm_efficiency=math.inf)
"""Only the memory traffic left (a factor of infinity makes its term zero)."""
WITHOUT_MEMORY = Calibration(memory_efficiency=math.inf, comm_efficiency=math.inf)


@dataclass(frozen=True, kw_only=True, slots=True)
class StepParts:
    """Per strategy, seconds of the raw model's step by kind of term, and the host's micro-batches."""

    matrix_s: np.ndarray
    """The matrix products' arithmetic (the system's matrix rate and efficiency curve)."""
    memory_s: np.ndarray
    """Memory traffic: elementwise kernels, the matmuls' operands, the optimizer (and the vector
    arithmetic of memory-bound kernels)."""
    comm_s: np.ndarray
    """Communication not hidden under compute."""
    host_s: np.ndarray
    """The backend profile's host dispatch (zero on a system without asynchronous dispatch)."""
    micro_batches: np.ndarray
    """Micro-batches of host work per step, in whole-model units (:func:`host_micro_batches`)."""

    @classmethod
    def of(cls, **values: float | Sequence[float] | np.ndarray) -> StepParts:
        """From numbers or sequences (missing parts are zero; one micro-batch by default)."""
        size = max(np.size(value) for value in values.values())
        defaults = {"matrix_s": 0.0, "memory_s": 0.0, "comm_s": 0.0, "host_s": 0.0, "micro_batches": 1.0}
        merged = {**defaults, **values}
        return cls(**{key: np.broadcast_to(np.asarray(v, dtype=float), (size,)) for key, v in merged.items()})

    @classmethod
    def concat(cls, parts: Sequence[StepParts]) -> StepParts:
        return cls(**{f.name: np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(cls)})

    def __len__(self) -> int:
        return int(self.matrix_s.size)

    def take(self, rows: Sequence[int] | np.ndarray | int) -> StepParts:
        """The parts of some strategies (in that order)."""
        index = np.atleast_1d(np.asarray(rows, dtype=int))
        return StepParts(**{f.name: getattr(self, f.name)[index] for f in fields(self)})

    @property
    def device_s(self) -> np.ndarray:
        return self.matrix_s + self.memory_s + self.comm_s

    @property
    def raw_step_s(self) -> np.ndarray:
        """The uncorrected model's step: the larger of the host's dispatch and the device's work."""
        return np.maximum(self.host_s, self.device_s)


def host_micro_batches(strategy: Strategy) -> float:
    """Micro-batches of host work per step on one rank, in whole-model units (a stage holds 1/pp of it)."""
    return strategy.micro_batches / strategy.pp


def model_step_parts(
    model: ModelConfig | ModelShape,
    strategies: Sequence[Strategy],
    system: System,
    dtype: str = "bf16",
    *,
    backend: str | BackendProfile = "native",
) -> StepParts:
    """The raw model's step of each strategy in parts (three vectorised predictions)."""
    array = StrategyArray.from_strategies(list(strategies))

    def device(calibration: Calibration | None) -> tuple[np.ndarray, np.ndarray]:
        prediction = predict(model, array, system, dtype=dtype, calibration=calibration, backend=backend)
        return prediction.iteration_time_s - prediction.host_bound_s, prediction.host_dispatch_s

    total, host = device(None)
    memory, _ = device(WITHOUT_MATRIX)
    matrix, _ = device(WITHOUT_MEMORY)
    return StepParts(
        matrix_s=matrix,
        memory_s=memory,
        # What the overlap rules leave exposed, so the parts add up to the model's device time.
        comm_s=np.maximum(total - matrix - memory, 0.0),
        host_s=host,
        micro_batches=np.array([host_micro_batches(s) for s in strategies], dtype=float),
    )
