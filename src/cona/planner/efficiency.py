"""Gradient noise scale, statistical efficiency and progress per second (pure numpy).

Notation (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training", App. A.1; Pollux, OSDI'21):
``G`` is the true gradient, ``Sigma`` the per-sample gradient covariance, ``M0`` the base global batch
(``training.base_gbs``, the batch the LR was tuned for), ``M`` a global batch, ``s = M / M0`` the scale.
Batches count samples (sequences). The noise scale ``phi = tr(Sigma) / |G|^2`` (McCandlish's ``B_simple``) is
in samples too.

Inputs come from ``metrics.jsonl``: the engine measures, at one step and the same parameters, the mean
squared norm of gradients over "small" batches of ``gns_small_batch`` samples (``gns_small_sqr``) and the
squared norm of the mean gradient over the whole ``gns_big_batch`` (``gns_big_sqr``). Since
``E|g_B|^2 = |G|^2 + tr(Sigma)/B``, two batch sizes give unbiased estimates of both unknowns
(:func:`two_batch_estimate`).

Single estimates are very noisy (often ``|G|^2 < 0``) and early ones can be huge: in LR warm-up the gradient
norms are ~100x the later ones, and one such measurement can hold a bias-corrected EMA negative for
millions of tokens. :class:`NoiseScaleTracker` therefore keeps the per-measurement estimates of ``|G|^2``
and ``tr(Sigma)`` of a window of consumed samples (tokens / seq), restarts once the LR warm-up is over, and
averages each robustly (median of the means of consecutive groups, so one bad measurement or one bad
stretch moves nothing), moved along the groups' trend, where they have one, towards the newest
measurement (:func:`at_newest`: a plain average is half a window old); it divides only at the end (a
ratio of averages, as McCandlish advises), and reports "unknown" rather than an infinite noise scale when
the ``|G|^2`` average is not positive.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from cona.errors import PlanError
from cona.metrics_record import MetricsRecord

WINDOW_BASE_BATCHES = 500
"""The window, in ``M0`` batches of samples: measurements taken more than ``500 * M0`` samples before the
newest one leave the average (about the half-life of AdaptDL's EMA, ``0.999 ** 693 = 0.5`` per ``M0``), so
the estimate follows the noise scale as the loss falls, whatever the log interval."""
WINDOW_FRACTION = 0.75
"""Early in a run the window is shorter: the last 3/4 of the samples consumed so far. The noise scale
changes on the scale of the run's length (it follows the loss), and the warm-up's measurements leave the
average once the run is 4x as long as the warm-up."""
MIN_SAMPLES = 7
"""Measurements needed before the tracker reports a noise scale; fewer are too noisy to act on (seven give
three median-of-means groups, so one group of outliers moves nothing). The window always keeps at least this
many (a long log interval never makes a known noise scale unknown again). Seven is what a run has at its
first metrics line where a step has one micro-batch on one rank: the steps before that line are measured
after the first (``GNS_FIRST_STEPS``), 7 at a log interval of 8, so online mode's first decision comes
at the first line; eight would wait for the second line (one log interval more), ten for two more."""
MAX_KEPT = 512
"""At most this many measurements are kept (the oldest leave first): bounds the cost of an update."""
MAX_GROUPS = 7
"""Median-of-means groups: up to 3 of 7 consecutive groups may hold outliers without moving the median."""
MIN_TREND_GROUPS = 5
"""Groups needed before the averages follow a trend (:func:`at_newest`): with five, one bad group is in 4 of
the 10 pairwise slopes, and the median of the other 6 decides; with three it would be in 2 of 3."""
TREND_Z = 1.96
"""The Mann-Kendall statistic's threshold, in standard deviations, for a trend (two-sided 5%)."""


def two_batch_estimate(
    small_sqr: np.ndarray | float,
    big_sqr: np.ndarray | float,
    small_batch: np.ndarray | float,
    big_batch: np.ndarray | float,
) -> tuple[np.ndarray, np.ndarray]:
    """Unbiased ``(|G|^2, tr(Sigma))`` from squared gradient norms at two batch sizes (McCandlish A.1).

    ``|G|^2 = (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)`` and
    ``tr(Sigma) = (|G_small|^2 - |G_big|^2) / (1/B_small - 1/B_big)``. Vectorised over arrays.
    Either estimate can be negative for one measurement; only averages of them are meaningful.
    """
    small_sqr, big_sqr = np.asarray(small_sqr, dtype=np.float64), np.asarray(big_sqr, dtype=np.float64)
    small_batch, big_batch = (
        np.asarray(small_batch, dtype=np.float64),
        np.asarray(big_batch, dtype=np.float64),
    )
    if np.any(small_batch <= 0) or np.any(big_batch <= small_batch):
        raise PlanError(
            "noise-scale inputs need 0 < gns_small_batch < gns_big_batch, got "
            f"gns_small_batch={small_batch.tolist()} gns_big_batch={big_batch.tolist()}"
        )
    grad_sqr = (big_batch * big_sqr - small_batch * small_sqr) / (big_batch - small_batch)
    trace_sigma = (small_sqr - big_sqr) / (1.0 / small_batch - 1.0 / big_batch)
    return grad_sqr, trace_sigma


@dataclass(frozen=True, kw_only=True, slots=True)
class NoiseScaleEstimate:
    """Smoothed gradient statistics; ``noise_scale`` is None when they do not determine it."""

    grad_sqr: float
    """``|G|^2``, the squared norm of the true gradient (robust average over the window)."""
    trace_sigma: float
    """``tr(Sigma)``, the summed per-sample gradient variance (robust average over the window)."""
    samples: int
    """Measurements averaged (those in the tracker's window)."""

    @property
    def noise_scale(self) -> float | None:
        """``phi = tr(Sigma) / |G|^2`` in samples; None ("unknown", never infinite) when ``|G|^2 <= 0``.

        A negative ``tr(Sigma)`` average (pure estimation noise) is clipped to 0: no measurable noise.
        """
        if not self.grad_sqr > 0.0:
            return None
        return max(self.trace_sigma, 0.0) / self.grad_sqr


Measurement = tuple[float, float, float]
"""(position in consumed samples, ``|G|^2`` estimate, ``tr(Sigma)`` estimate) of one measurement."""


@dataclass(frozen=True, kw_only=True, slots=True)
class NoiseScaleTracker:
    """Robust windowed averages of ``|G|^2`` and ``tr(Sigma)`` over two-batch measurements; immutable.

    ``update`` returns a new tracker, so the search thread can keep the history it wants and tests can replay.
    A measurement's position is the run's consumed samples (``metrics.jsonl``'s ``consumed_samples``); kept
    are the measurements of the last ``window`` samples (at least ``min_samples`` of them): a plain average
    over a window lags the noise scale by about half of it (an EMA by its whole horizon), so the estimate
    follows the averages' trend, where they have one, towards the newest measurement (:func:`at_newest`).
    The LR warm-up is over at the first measurement whose ``lr`` does not exceed the previous one's; from
    then on, once ``min_samples`` measurements follow it, the warm-up ones are dropped (a restart that never
    leaves the tracker without an estimate it had).
    """

    base_batch: int
    """``M0``: sets the window (see :data:`WINDOW_BASE_BATCHES`)."""
    min_samples: int = MIN_SAMPLES
    window: float | None = None
    """Window in samples; None: the smaller of ``WINDOW_BASE_BATCHES * base_batch`` and ``WINDOW_FRACTION``
    of the newest measurement's position."""
    measurements: tuple[Measurement, ...] = ()
    """The measurements in the window, oldest first."""
    samples: int = 0
    """Measurements folded in so far (also those that left the window)."""
    last_lr: float | None = None
    warmup_end: float | None = None
    """Position of the first measurement after the LR warm-up (None: still in it, or no LR seen)."""

    def __post_init__(self) -> None:
        if self.base_batch <= 0:
            raise PlanError(
                f"noise-scale tracker: base batch (training.base_gbs) must be positive, got {self.base_batch}"
            )

    def update(
        self,
        *,
        small_sqr: float,
        big_sqr: float,
        small_batch: int,
        big_batch: int,
        consumed_samples: float | None = None,
        lr: float | None = None,
    ) -> NoiseScaleTracker:
        """Fold in one two-batch measurement; a non-finite one (fp16 overflow step) is skipped.

        Without ``consumed_samples`` the measurement sits ``big_batch`` samples after the previous one.
        """
        if not (math.isfinite(small_sqr) and math.isfinite(big_sqr)):
            return self
        grad_sqr, trace_sigma = two_batch_estimate(small_sqr, big_sqr, small_batch, big_batch)
        if consumed_samples is None:
            consumed_samples = (self.measurements[-1][0] if self.measurements else 0.0) + big_batch
        position = float(consumed_samples)
        warmup_end = self.warmup_end
        if warmup_end is None and lr is not None and self.last_lr is not None and lr <= self.last_lr:
            warmup_end = position
        kept = (*self.measurements, (position, float(grad_sqr), float(trace_sigma)))
        return replace(
            self,
            measurements=self._trimmed(kept, warmup_end),
            samples=self.samples + 1,
            last_lr=self.last_lr if lr is None else float(lr),
            warmup_end=warmup_end,
        )

    def _trimmed(self, kept: tuple[Measurement, ...], warmup_end: float | None) -> tuple[Measurement, ...]:
        """Drop warm-up measurements once enough follow it, then those outside the window (keeping
        ``min_samples``), then all beyond :data:`MAX_KEPT`."""
        if warmup_end is not None and kept[0][0] < warmup_end:
            after = tuple(m for m in kept if m[0] >= warmup_end)
            if len(after) >= self.min_samples:
                kept = after
        newest = kept[-1][0]
        window = self.window
        if window is None:
            window = min(WINDOW_BASE_BATCHES * self.base_batch, WINDOW_FRACTION * newest)
        first = 0
        while len(kept) - first > self.min_samples and kept[first][0] < newest - window:
            first += 1
        return kept[max(first, len(kept) - MAX_KEPT) :]

    def update_from_metrics(self, record: MetricsRecord | Mapping[str, Any]) -> NoiseScaleTracker:
        """Fold in one ``metrics.jsonl`` record (its ``consumed_samples`` and ``lr`` where it has them; a
        decoded line is read as a :class:`MetricsRecord`); records without all four ``gns_*`` fields are
        skipped. A record that lists its measured steps (``gns_steps``) gives one measurement per step,
        all at the line's position; the line's LR goes with the first only, so that two steps of one line
        never read as the end of the LR warm-up."""
        if not isinstance(record, MetricsRecord):
            record = MetricsRecord.from_dict(record)
        small_sqr, big_sqr = record.gns_small_sqr, record.gns_big_sqr
        small_batch, big_batch = record.gns_small_batch, record.gns_big_batch
        if small_sqr is None or big_sqr is None or small_batch is None or big_batch is None:
            return self
        position, lr = record.consumed_samples, record.lr
        pairs = record.gns_steps or [[small_sqr, big_sqr]]
        tracker = self
        for index, (step_small_sqr, step_big_sqr) in enumerate(pairs):
            tracker = tracker.update(
                small_sqr=float(step_small_sqr),
                big_sqr=float(step_big_sqr),
                small_batch=int(small_batch),
                big_batch=int(big_batch),
                consumed_samples=None if position is None else float(position),
                lr=None if lr is None or index else float(lr),
            )
        return tracker

    def estimate(self) -> NoiseScaleEstimate | None:
        """The robust averages over the window, or None with fewer than :attr:`min_samples` measurements."""
        if len(self.measurements) < self.min_samples or not self.measurements:
            return None
        rows = np.asarray(self.measurements, dtype=np.float64)
        grad_sqr, trace_sigma = at_newest(rows[:, 0], rows[:, 1:])
        return NoiseScaleEstimate(grad_sqr=grad_sqr, trace_sigma=trace_sigma, samples=len(self.measurements))

    def noise_scale(self) -> float | None:
        """``phi`` in samples, or None when unknown (too few samples, or the ``|G|^2`` average <= 0)."""
        estimate = self.estimate()
        return None if estimate is None else estimate.noise_scale


def at_newest(positions: np.ndarray, values: np.ndarray) -> tuple[float, float]:
    """The robust averages of ``values``' columns (``|G|^2``, ``tr(Sigma)``), moved towards the newest
    position where they have a trend across the window.

    A plain average over the window is the value of about half a window ago: while the noise scale grows
    (the loss falling fast), a GPT-125M run's plain average is 0.7-0.85 of the noise scale centred on the
    moment over its first 1-6M tokens, a bias towards small batches where the batch decisions are made. So
    each column whose :data:`MIN_TREND_GROUPS` or more median-of-means groups all have positive means, and
    whose group means rise or fall with position by the Mann-Kendall test (:func:`has_trend`; a level that
    only scatters keeps its plain average, which a fitted slope would only make noisier), is carried along the
    Theil-Sen slope of its log group means (the median of the pairwise slopes, which a minority of bad groups
    moves little) to the newest position: the median over groups of their means carried so. Log, because
    ``|G|^2`` falls about geometrically.
    The result stays between the plain average and the newest group's mean: a trend that bends (a tiny
    run's ``tr(Sigma)`` rising fast, then slower) would carry it past what the newest measurements say.
    Other columns: the plain :func:`median_of_means`.
    """
    plain = [median_of_means(values[:, column]) for column in range(values.shape[1])]
    groups = group_count(len(values))
    if groups < MIN_TREND_GROUPS:
        return plain[0], plain[1]
    centres = np.array([part.mean() for part in np.array_split(positions, groups)])
    means = np.array([part.mean(axis=0) for part in np.array_split(values, groups)])
    first, second = np.triu_indices(groups, k=1)
    run = centres[second] - centres[first]
    ordered = run > 0.0  # pairs of groups at one position (one line's steps) say nothing of a trend
    moved = list(plain)
    for column in range(values.shape[1]):
        if not np.all(means[:, column] > 0.0):
            continue
        logs = np.log(means[:, column])
        rise = (logs[second] - logs[first])[ordered]
        if not has_trend(np.sign(rise), groups):
            continue
        slope = float(np.median(rise / run[ordered]))
        carried = float(np.exp(np.median(logs + slope * (positions[-1] - centres))))
        low, high = sorted((plain[column], float(means[-1, column])))
        moved[column] = min(max(carried, low), high)
    return moved[0], moved[1]


def has_trend(signs: np.ndarray, groups: int) -> bool:
    """Mann-Kendall: whether the pairwise ``signs`` of later minus earlier group means show a monotone
    trend at the two-sided 5% level (``|S| - 1 >= 1.96 sd``, ``var S = n (n - 1) (2n + 5) / 18``): with 5
    groups all 10 pairs must agree, with 7 at least 18 of 21. Pairs left out (groups at one position) add
    0 to ``S`` against the variance of all pairs, which only makes the test stricter."""
    score = abs(float(signs.sum()))
    variance = groups * (groups - 1) * (2 * groups + 5) / 18.0
    return score - 1.0 >= TREND_Z * math.sqrt(variance)


def group_count(count: int) -> int:
    """Median-of-means groups for ``count`` values: at most :data:`MAX_GROUPS`, of two values or more, odd."""
    groups = max(1, min(MAX_GROUPS, count // 2))
    return groups - (1 - groups % 2)


def median_of_means(values: np.ndarray) -> float:
    """The median of the means of up to :data:`MAX_GROUPS` (an odd number) consecutive groups.

    Consecutive, not interleaved: a stretch of bad measurements (a warm-up) then spoils few groups. Groups of
    at least two keep most of the mean's efficiency on the skewed single estimates, whose plain median would
    be biased.
    """
    groups = group_count(len(values))  # odd: the median is one group's mean
    return float(np.median([part.mean() for part in np.array_split(values, groups)]))


def statistical_efficiency(batch: np.ndarray | float, noise_scale: float, base_batch: float) -> np.ndarray:
    """Progress per sample at ``batch`` relative to ``base_batch``: ``(phi + M0) / (phi + M)`` (Pollux).

    1 at ``M = M0``, falling as ``M`` grows past the noise scale; above 1 for ``M < M0``.
    """
    _check_noise_scale(noise_scale)
    return (noise_scale + base_batch) / (noise_scale + np.asarray(batch, dtype=np.float64))


def progress_per_second(
    samples_per_s: np.ndarray | float, batch: np.ndarray | float, noise_scale: float, base_batch: float
) -> np.ndarray:
    """Training progress per second in ``M0``-equivalent samples: throughput x statistical efficiency."""
    return np.asarray(samples_per_s, dtype=np.float64) * statistical_efficiency(
        batch, noise_scale, base_batch
    )


def adascale_gain(batch: np.ndarray | float, noise_scale: float, base_batch: float) -> np.ndarray:
    """AdaScale gain ``r = (var + sqr) / (var/s + sqr)`` with ``var/sqr = phi/M0`` and ``s = M/M0``.

    Equals ``s x statistical_efficiency``: progress per step in ``M0``-steps, between ``min(1, s)`` and
    ``max(1, s)`` (1 with no noise, ``s`` with no signal).
    """
    _check_noise_scale(noise_scale)
    scale = np.asarray(batch, dtype=np.float64) / base_batch
    return (noise_scale + base_batch) / (noise_scale / scale + base_batch)


def _check_noise_scale(noise_scale: float) -> None:
    if not (math.isfinite(noise_scale) and noise_scale >= 0.0):
        raise PlanError(f"noise scale must be a finite non-negative number of samples, got {noise_scale}")
