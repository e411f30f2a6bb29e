"""How far a trace got: its progress in base-batch-equivalent tokens, and its noise scale along that progress.

What the offline planner (:mod:`cona.planner.plan`) reads off a measured trace before it assigns batch sizes.
"""

from __future__ import annotations

import numpy as np

from cona.errors import PlanError
from cona.planner.chains import NoiseProfile
from cona.planner.efficiency import NoiseScaleEstimate
from cona.planner.trace import Trace


def trace_progress(trace: Trace, base_gbs: int, *, noise_scale_factor: float = 1.0) -> np.ndarray:
    """Base-batch-equivalent tokens the trace had made at each of its measurements.

    The interval before a measurement counts at the efficiency of the estimate known at its start, with
    ``(phi + M0) / (phi + M)`` written out because ``phi`` varies along the trace; ``phi`` is the measured
    noise scale times ``noise_scale_factor``.
    """
    steps = np.diff(trace.tokens, prepend=0.0)
    noise = np.asarray([0.0] + [_phi(trace.estimate(i)) for i in range(len(trace.tokens) - 1)])
    noise = noise * noise_scale_factor
    return np.cumsum(steps * (noise + base_gbs) / (noise + trace.gbs))


def _phi(estimate: NoiseScaleEstimate | None) -> float:
    if estimate is None or estimate.noise_scale is None:
        return 0.0
    return estimate.noise_scale


def progress_at_tokens(
    trace: Trace, base_gbs: int, tokens: float, *, noise_scale_factor: float = 1.0
) -> float:
    """The trace's progress after ``tokens`` consumed tokens (PlanError beyond its end)."""
    if tokens > trace.tokens[-1] * (1 + 1e-9):
        raise PlanError(
            f"{trace.source}: the trace covers {trace.tokens[-1]:.4g} tokens, fewer than the {tokens:.4g} "
            "asked for (--total-tokens / --total-iters)"
        )
    points = np.concatenate([[0.0], trace.tokens])
    progress = np.concatenate([[0.0], trace_progress(trace, base_gbs, noise_scale_factor=noise_scale_factor)])
    return float(np.interp(tokens, points, progress))


def noise_profile(
    trace: Trace, base_gbs: int, target_progress: float, segments: int, *, noise_scale_factor: float = 1.0
) -> NoiseProfile:
    """The trace's noise scale on ``segments`` equal steps of progress up to ``target_progress`` (progress
    and the profile's ``phi`` with the measured noise scale times ``noise_scale_factor``)."""
    if segments < 1:
        raise PlanError(f"--segments must be at least 1, got {segments}")
    if not target_progress > 0:
        raise PlanError("the target lies at the very start of the trace: nothing to plan")
    progress = trace_progress(trace, base_gbs, noise_scale_factor=noise_scale_factor)
    edges = np.linspace(0.0, target_progress, segments + 1)
    # The last measurement at or before each segment's start is what the tracker knows there.
    known = np.searchsorted(progress, edges[:-1], side="right") - 1
    estimates = tuple(None if index < 0 else trace.estimate(int(index)) for index in known)
    return NoiseProfile(edges=edges, estimates=estimates, noise_scale_factor=noise_scale_factor)
