"""The performance model's correction factors, apart from their fit (:mod:`cona.planner.calibration`) so
that the model, which applies them, does not import the fit, which runs the model."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """Correction factors for :func:`cona.planner.perf_model.predict` and how well they fit.

    Each factor divides one kind of term, because each kind misses by its own ratio: the matrix products'
    arithmetic (the system's matrix efficiency curve), the memory traffic (its memory efficiency curve:
    elementwise kernels, the matmuls' operand traffic, the optimizer), the communication, and the host's
    kernel dispatch (the backend profile's), which the step takes the larger of with the device's work.
    One factor for the whole device would fit a single ratio where the ratio changes with the model's size:
    the share of memory traffic in a step falls as the model grows (docs/perf-model.md, "Calibration").
    """

    matrix_efficiency: float = 1.0
    """Divides the matrix products' arithmetic time."""
    memory_efficiency: float = 1.0
    """Divides the memory-traffic time (and the vector arithmetic of memory-bound kernels)."""
    comm_efficiency: float = 1.0
    host_efficiency: float = 1.0
    """Divides the host dispatch time (systems with asynchronous dispatch only)."""
    overhead_s: float = 0.0
    """Seconds per micro-batch, added after the ``max(host, device)``."""
    error_before: float = float("nan")
    """Mean absolute relative error of the uncorrected model on the measurements."""
    error_after: float = float("nan")
    measurements: int = 0
