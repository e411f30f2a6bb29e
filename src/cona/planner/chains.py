"""The arithmetic of chains on the progress axis (:mod:`cona.planner.plan`): a noise profile over equal
segments of progress, each candidate's seconds and tokens per segment, a chain's time and the hindsight
optimum by dynamic programming."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from cona.planner.efficiency import NoiseScaleEstimate
from cona.planner.policy import Candidate


@dataclass(frozen=True, kw_only=True)
class NoiseProfile:
    """The noise scale over equal segments of progress, from 0 to the target."""

    edges: np.ndarray
    """``segments + 1`` progress values (base-batch-equivalent tokens)."""
    estimates: tuple[NoiseScaleEstimate | None, ...]
    """The tracker's estimate at each segment's start (None: no estimate yet)."""
    noise_scale_factor: float = 1.0
    """The efficiency's ``phi`` is the measured noise scale times this (``training.noise_scale_factor``)."""

    @cached_property
    def noise_scale(self) -> np.ndarray:
        """Per segment, the efficiency's ``phi`` in samples; an unknown noise scale counts as 0 (no evidence
        that big batches help)."""
        values = [
            e.noise_scale if e is not None and e.noise_scale is not None else 0.0 for e in self.estimates
        ]
        return np.asarray(values, dtype=np.float64) * self.noise_scale_factor


def segment_times(profile: NoiseProfile, candidates: tuple[Candidate, ...], base_gbs: int) -> np.ndarray:
    """Seconds each candidate needs for each segment: ``[segments, candidates]``."""
    width = np.diff(profile.edges)[:, None]
    noise = profile.noise_scale[:, None]
    gbs = np.asarray([c.strategy.gbs for c in candidates], dtype=np.float64)[None, :]
    tokens_per_s = np.asarray([c.predicted_tokens_per_s for c in candidates])[None, :]
    return width / (tokens_per_s * (noise + base_gbs) / (noise + gbs))


def switch_costs(count: int, cost_s: float | np.ndarray) -> np.ndarray:
    """``[from, to]`` seconds of a change between ``count`` candidates: ``cost_s`` itself when it is such a
    matrix, else that one cost for every change (0 to stay)."""
    if np.ndim(cost_s) == 2:
        return np.asarray(cost_s, dtype=np.float64)
    return float(cost_s) * (1.0 - np.eye(count))


def chain_time(times: np.ndarray, assignment: np.ndarray, cost_s: float | np.ndarray) -> float:
    """Total seconds of a chain: its segment times plus the cost of every change of candidate (one cost, or
    a ``[from, to]`` matrix: :func:`switch_costs`)."""
    costs = switch_costs(times.shape[1], cost_s)
    segments = times[np.arange(len(assignment)), assignment].sum()
    return float(segments + costs[assignment[:-1], assignment[1:]].sum())


def optimal_assignment(times: np.ndarray, cost_s: float | np.ndarray) -> np.ndarray:
    """The hindsight-optimal candidate of every segment: dynamic programming over (segment, candidate) with
    the cost of every change (:func:`switch_costs`); any candidate may start."""
    segments, count = times.shape
    change = switch_costs(count, cost_s)
    best = times[0].copy()
    previous = np.zeros((segments, count), dtype=np.int64)
    for k in range(1, segments):
        arriving = best[:, None] + change  # [from, to]
        previous[k] = np.argmin(arriving, axis=0)
        best = arriving[previous[k], np.arange(count)] + times[k]
    assignment = np.empty(segments, dtype=np.int64)
    assignment[-1] = int(np.argmin(best))
    for k in range(segments - 1, 0, -1):
        assignment[k - 1] = previous[k, assignment[k]]
    return assignment


def raw_tokens(profile: NoiseProfile, candidates: tuple[Candidate, ...], base_gbs: int) -> np.ndarray:
    """Tokens each candidate trains over each segment: its progress divided by its efficiency."""
    width = np.diff(profile.edges)[:, None]
    noise = profile.noise_scale[:, None]
    gbs = np.asarray([c.strategy.gbs for c in candidates], dtype=np.float64)[None, :]
    return width * (noise + gbs) / (noise + base_gbs)
