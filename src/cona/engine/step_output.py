"""What a training step reports: :class:`StepOutput` (Python numbers, what the trainer logs) and
:class:`PendingStepOutput` (the same numbers still on the device), and fp16's dynamic loss scaler."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class StepOutput:
    """What one training step reports (the gradient-noise inputs are explained in :mod:`cona.engine.gns`).

    The GNS norms are NaN when the step gives no estimate (a step not measured, the first step of the
    difference estimator, an fp16 overflow); consumers skip non-finite values.
    """

    loss: float
    """Mean token loss over the whole global batch, identical on every rank."""
    gns_small_sqr: float
    """Squared gradient norm over a small batch (mean over the small batches measured)."""
    gns_big_sqr: float
    """Squared norm of the big-batch mean gradient (normally the global batch), before clipping."""
    gns_small_batch: int
    """Samples in a small batch."""
    gns_big_batch: int
    """Samples in the big batch."""


@dataclass(frozen=True, kw_only=True)
class PendingStepOutput:
    """A :class:`StepOutput` whose numbers are still 0-d float32 device tensors.

    Returned by :meth:`TrainingModel.train_step_pending`, so that a training loop can queue the next step
    before the device has finished this one; :meth:`result` waits for the device (one host sync).
    """

    loss: torch.Tensor
    gns_small_sqr: torch.Tensor
    gns_big_sqr: torch.Tensor
    gns_small_batch: int
    gns_big_batch: int

    def result(self) -> StepOutput:
        loss, small, big = torch.stack([self.loss, self.gns_small_sqr, self.gns_big_sqr]).tolist()
        return StepOutput(
            loss=loss,
            gns_small_sqr=small,
            gns_big_sqr=big,
            gns_small_batch=self.gns_small_batch,
            gns_big_batch=self.gns_big_batch,
        )


class LossScaler:
    """Dynamic loss scaling for fp16 (GradScaler's rule on plain floats, so it works with DTensor grads).

    The scale doubles after ``growth_interval`` overflow-free steps and halves on an overflow (that step is
    skipped); whether a step overflowed comes from the global grad norm, which every rank already shares.
    """

    def __init__(self, *, enabled: bool, initial_scale: float = 2.0**16, growth_interval: int = 1000) -> None:
        self.enabled = enabled
        self.scale = initial_scale if enabled else 1.0
        self.growth_interval = growth_interval
        self._good_steps = 0

    def update(self, *, found_inf: bool) -> None:
        if not self.enabled:
            return
        if found_inf:
            self.scale = max(self.scale / 2, 1.0)
            self._good_steps = 0
            return
        self._good_steps += 1
        if self._good_steps % self.growth_interval == 0:
            self.scale *= 2
