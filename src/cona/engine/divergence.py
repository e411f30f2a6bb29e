"""Divergence is a failure, not a finished run: the checks each metrics line makes.

A run whose LR is far too high skips step after step for non-finite gradients, or its loss climbs by orders
of magnitude; before this check such a run ended "completed" with exit 0. At every metrics line (whose means
are one host read the trainer makes anyway, so nothing is added to the step) :class:`DivergenceWatch`
counts consecutive skipped steps and compares the line's mean loss with the lowest so far; past
``training.max_skipped_steps`` or ``training.divergence_loss_factor`` it raises :class:`TrainingDiverged`,
which the worker reports as its stage's error and the command exits non-zero. Every rank holds the same
all-reduced loss and global gradient norm, so all ranks stop at the same line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cona.config import TrainingConfig
from cona.errors import TrainingDiverged


@dataclass(kw_only=True)
class DivergenceWatch:
    max_skipped_steps: int
    loss_factor: float
    skipped_in_a_row: int = 0
    lowest_loss: float = math.inf

    @classmethod
    def from_training(cls, training: TrainingConfig) -> DivergenceWatch:
        return cls(max_skipped_steps=training.max_skipped_steps, loss_factor=training.divergence_loss_factor)

    def check(self, *, iteration: int, loss: float, steps: int, skipped: int) -> None:
        """One metrics line: ``steps`` in its interval, ``skipped`` of them, ``loss`` their mean."""
        # Skips at the end of an interval continue into the next one; a stepped interval ends the run.
        self.skipped_in_a_row = self.skipped_in_a_row + skipped if skipped == steps else skipped
        if self.skipped_in_a_row >= self.max_skipped_steps:
            raise TrainingDiverged(
                f"training diverged at iteration {iteration}: {self.skipped_in_a_row} steps in a row skipped "
                f"for non-finite gradients (training.max_skipped_steps {self.max_skipped_steps}); lower "
                "training.base_lr or raise training.clip_grad's protection"
            )
        if not math.isfinite(loss):
            if skipped < steps:
                raise TrainingDiverged(f"training diverged at iteration {iteration}: the loss is {loss}")
            return  # only skipped steps: counted above
        if self.loss_factor and loss > self.loss_factor * self.lowest_loss:
            raise TrainingDiverged(
                f"training diverged at iteration {iteration}: mean loss {loss:.4g} is over "
                f"{self.loss_factor:g}x the lowest so far ({self.lowest_loss:.4g}; "
                "training.divergence_loss_factor); lower training.base_lr"
            )
        self.lowest_loss = min(self.lowest_loss, loss)
