"""The performance model's correction factors, as :func:`cona.planner.perf_model.predict` applies them
inside its kernels; apart from the model so that the model does not import what corrects it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """Correction factors for :func:`cona.planner.perf_model.predict`.

    Each factor divides one kind of term, because each kind's prior misses by its own ratio: the matrix
    products' arithmetic (the system's matrix efficiency curve), the memory traffic (its memory efficiency
    curve: elementwise kernels, the matmuls' operand traffic, the optimizer), the communication, and the
    host's kernel dispatch (the backend profile's), of which and the device's work the step takes the
    larger. The fit on measured steps (:mod:`cona.planner.step_shape`) scales the same terms
    (:mod:`cona.planner.step_parts` splits the step with these factors).
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
