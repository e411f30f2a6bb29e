"""The performance model's correction factors, apart from their fit (:mod:`cona.planner.calibration`) so
that the model, which applies them, does not import the fit, which runs the model."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """Correction factors for :func:`cona.planner.perf_model.predict` and how well they fit."""

    compute_efficiency: float = 1.0
    comm_efficiency: float = 1.0
    overhead_s: float = 0.0
    """Seconds per micro-batch."""
    error_before: float = float("nan")
    """Mean absolute relative error of the uncorrected model on the measurements."""
    error_after: float = float("nan")
    measurements: int = 0
