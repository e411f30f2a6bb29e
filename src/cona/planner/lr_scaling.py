"""Learning rate at a global batch size other than the one it was tuned for (pure functions).

``training.base_lr`` and ``training.base_min_lr`` were tuned at ``training.base_gbs``; when a chain stage
runs at another ``gbs``, ``training.lr_scale_strategy`` gives the factor applied to them (s = gbs / base_gbs):

* ``linear``: ``s`` (Goyal et al. 2017);
* ``sqrt``: ``s ** 0.5`` (Krizhevsky 2014; the Adam SDE rule of Malladi et al. 2022);
* ``power``: ``s ** lr_scale_exp``;
* ``piecewise``: ``lr_scale_low_exp`` up to ``lr_scale_pivot_gbs`` and ``lr_scale_high_exp`` above it,
  continuous at the pivot;
* ``adascale``: the AdaScale gain ``r = (var + sqr) / (var/s + sqr)`` from the noise scale measured so far
  (Johnson et al. 2020; see :func:`cona.planner.efficiency.adascale_gain`).

``lr_scale_lr_cap`` bounds the LR; ``scale_min_lr`` says whether the min LR gets the same factor. The min LR
never exceeds the LR.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cona.config import TrainingConfig
from cona.errors import PlanError
from cona.planner.efficiency import NoiseScaleEstimate, adascale_gain


@dataclass(frozen=True, kw_only=True, slots=True)
class ScaledLR:
    """The learning rates for one global batch size, and how they were obtained."""

    lr: float
    """Peak LR: ``min(base_lr x factor, lr_scale_lr_cap)``."""
    min_lr: float
    """End-of-decay LR: ``min(base_min_lr x min_lr_factor, lr)``."""
    factor: float
    """The rule's factor before the cap (logged so a capped LR is visible as such)."""
    min_lr_factor: float
    """Factor applied to ``base_min_lr``: ``factor`` when ``scale_min_lr``, else 1."""
    capped: bool
    """Whether ``lr_scale_lr_cap`` lowered the LR."""


def scaled_lr(
    training: TrainingConfig, gbs: int, *, noise_scale: NoiseScaleEstimate | None = None
) -> ScaledLR:
    """Scale ``training``'s base LRs to ``gbs`` with its ``lr_scale_strategy`` (see the module docstring).

    ``noise_scale`` is only used by ``adascale``. Without a usable estimate (None, or ``|G|^2 <= 0``)
    adascale takes the smallest gain AdaScale could produce, ``min(1, s)``: it keeps the base LR when the
    batch grows (the gain at zero gradient noise) and scales linearly down when it shrinks. This is the
    conservative end: AdaptDL instead takes the gain ``s`` there, i.e. assumes perfect scaling exactly when it
    knows least.
    """
    if gbs <= 0:
        raise PlanError(
            f"cannot scale the learning rate to gbs={gbs}: the global batch size must be positive"
        )
    factor = lr_factor(training, gbs, noise_scale=noise_scale)
    uncapped_lr = training.lr.base_lr * factor
    cap = training.lr.lr_scale_lr_cap
    lr = uncapped_lr if cap is None else min(uncapped_lr, cap)
    min_lr_factor = factor if training.lr.scale_min_lr else 1.0
    min_lr = min(training.lr.base_min_lr * min_lr_factor, lr)
    return ScaledLR(lr=lr, min_lr=min_lr, factor=factor, min_lr_factor=min_lr_factor, capped=lr < uncapped_lr)


def lr_factor(training: TrainingConfig, gbs: int, *, noise_scale: NoiseScaleEstimate | None = None) -> float:
    """The multiplier of ``base_lr`` at ``gbs`` under ``training.lr_scale_strategy`` (no cap applied)."""
    base = training.lr.base_gbs
    scale = gbs / base
    strategy = training.lr.lr_scale_strategy
    if strategy == "linear":
        return scale
    if strategy == "sqrt":
        return math.sqrt(scale)
    if strategy == "power":
        return scale**training.lr.lr_scale_exp
    if strategy == "piecewise":
        return _piecewise_factor(training, gbs)
    if strategy == "adascale":
        phi = noise_scale.noise_scale if noise_scale is not None else None
        if phi is None:
            return min(1.0, scale)
        return float(adascale_gain(gbs, phi, base))
    raise PlanError(f"training.lr_scale_strategy: unknown rule {strategy!r}")


def _piecewise_factor(training: TrainingConfig, gbs: int) -> float:
    """The LR factor on a curve of exponent ``low`` below the pivot and ``high`` above, continuous there.

    The LR curve as a function of gbs has slope exponent ``low`` below the pivot and ``high`` above it, and is
    anchored at ``base_lr`` at ``base_gbs`` wherever the base lies. In log space:
    ``log f = low x (log min(g, p) - log min(b, p)) + high x (log max(g, p) - log max(b, p))``.
    With the base below the pivot and ``gbs`` above it this is ``(p/b)^low x (g/p)^high``.
    """
    pivot = training.lr.lr_scale_pivot_gbs
    if pivot is None:
        raise PlanError("training.lr_scale_pivot_gbs is required by lr_scale_strategy 'piecewise'")
    base = training.lr.base_gbs
    log_factor = training.lr.lr_scale_low_exp * (math.log(min(gbs, pivot)) - math.log(min(base, pivot)))
    log_factor += training.lr.lr_scale_high_exp * (math.log(max(gbs, pivot)) - math.log(max(base, pivot)))
    return math.exp(log_factor)
