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
(:func:`two_batch_estimate`). Single estimates are very noisy (often ``|G|^2 < 0``), so
:class:`NoiseScaleTracker` smooths ``|G|^2`` and ``tr(Sigma)`` in two separate bias-corrected EMAs and divides
only at the end (a ratio of averages, as McCandlish advises), and reports "unknown" rather than an infinite
noise scale when the ``|G|^2`` average is not positive.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np

from cona.errors import PlanError

EMA_DECAY_PER_BASE_BATCH = 0.999
"""EMA decay per ``M0`` samples: one step at batch ``M`` decays by ``0.999 ** (M / M0)``, so the average
remembers about ``1000 * M0`` samples whatever the batch size (AdaptDL's choice after its PR #54)."""
MIN_SAMPLES = 10
"""Measurements needed before the tracker reports a noise scale; fewer are too noisy to act on."""
METRIC_KEYS = ("gns_small_sqr", "gns_big_sqr", "gns_small_batch", "gns_big_batch")


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
    """``|G|^2``, the squared norm of the true gradient (bias-corrected EMA)."""
    trace_sigma: float
    """``tr(Sigma)``, the summed per-sample gradient variance (bias-corrected EMA)."""
    samples: int
    """Measurements averaged into the EMAs."""

    @property
    def noise_scale(self) -> float | None:
        """``phi = tr(Sigma) / |G|^2`` in samples; None ("unknown", never infinite) when ``|G|^2 <= 0``.

        A negative ``tr(Sigma)`` average (pure estimation noise) is clipped to 0: no measurable noise.
        """
        if not self.grad_sqr > 0.0:
            return None
        return max(self.trace_sigma, 0.0) / self.grad_sqr


@dataclass(frozen=True, kw_only=True, slots=True)
class NoiseScaleTracker:
    """Two bias-corrected EMAs (Adam-style, ``m/c``) of ``|G|^2`` and ``tr(Sigma)``; immutable.

    ``update`` returns a new tracker, so the search thread can keep the history it wants and tests can replay.
    """

    base_batch: int
    """``M0``: sets the EMA horizon (see :data:`EMA_DECAY_PER_BASE_BATCH`)."""
    min_samples: int = MIN_SAMPLES
    grad_sqr_sum: float = 0.0
    trace_sigma_sum: float = 0.0
    weight: float = 0.0
    """Sum of the EMA weights; dividing by it is the bias correction."""
    samples: int = 0

    def __post_init__(self) -> None:
        if self.base_batch <= 0:
            raise PlanError(
                f"noise-scale tracker: base batch (training.base_gbs) must be positive, got {self.base_batch}"
            )

    def update(
        self, *, small_sqr: float, big_sqr: float, small_batch: int, big_batch: int
    ) -> NoiseScaleTracker:
        """Fold in one two-batch measurement; a non-finite one (fp16 overflow step) is skipped."""
        if not (math.isfinite(small_sqr) and math.isfinite(big_sqr)):
            return self
        grad_sqr, trace_sigma = two_batch_estimate(small_sqr, big_sqr, small_batch, big_batch)
        decay = EMA_DECAY_PER_BASE_BATCH ** (big_batch / self.base_batch)
        return replace(
            self,
            grad_sqr_sum=decay * self.grad_sqr_sum + (1.0 - decay) * float(grad_sqr),
            trace_sigma_sum=decay * self.trace_sigma_sum + (1.0 - decay) * float(trace_sigma),
            weight=decay * self.weight + (1.0 - decay),
            samples=self.samples + 1,
        )

    def update_from_metrics(self, record: Mapping[str, object]) -> NoiseScaleTracker:
        """Fold in one ``metrics.jsonl`` record; records without all four ``gns_*`` fields are skipped."""
        if any(record.get(key) is None for key in METRIC_KEYS):
            return self
        return self.update(
            small_sqr=float(record["gns_small_sqr"]),
            big_sqr=float(record["gns_big_sqr"]),
            small_batch=int(record["gns_small_batch"]),
            big_batch=int(record["gns_big_batch"]),
        )

    def estimate(self) -> NoiseScaleEstimate | None:
        """The bias-corrected averages, or None before :attr:`min_samples` measurements."""
        if self.samples < self.min_samples or self.weight <= 0.0:
            return None
        return NoiseScaleEstimate(
            grad_sqr=self.grad_sqr_sum / self.weight,
            trace_sigma=self.trace_sigma_sum / self.weight,
            samples=self.samples,
        )

    def noise_scale(self) -> float | None:
        """``phi`` in samples, or None when unknown (too few samples, or the ``|G|^2`` average <= 0)."""
        estimate = self.estimate()
        return None if estimate is None else estimate.noise_scale


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
