"""Divergence is a failure, not a finished run: the checks each metrics line makes, and which states may
become the checkpoint a rerun resumes from.

A run whose LR is far too high skips step after step for non-finite gradients, or its loss climbs by orders
of magnitude; before this check such a run ended "completed" with exit 0. At every metrics line (whose means
are one host read the trainer makes anyway, so nothing is added to the step) :class:`DivergenceWatch`
counts consecutive skipped steps and compares the line's mean loss with the lowest so far; past
``training.max_skipped_steps`` or ``training.divergence_loss_factor`` it raises :class:`TrainingDiverged`,
which the worker reports as its stage's error and the command exits non-zero. Every rank holds the same
all-reduced loss and global gradient norm, so all ranks stop at the same line.

A loss can climb far without reaching that factor (8 to 77 is under 10x), so a state is judged once more
before it becomes ``latest`` (:meth:`DivergenceWatch.unfit_to_resume`): not when the newest line's loss is
over :data:`RESUME_LOSS_FACTOR` times the lowest, nor when it is above the loss of a uniform guess over the
vocabulary (``ln(vocab)``, nats) after the run was below it, by more than :data:`LOSS_NOISE_NATS` over the
lowest. The lowest loss travels in every checkpoint's
trainer state (:meth:`DivergenceWatch.trainer_state`), so a resumed run compares with the lowest of the whole
run, not of its own lines.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from cona.config import ConaConfig
from cona.errors import TrainingDiverged

RESUME_LOSS_FACTOR = 2.0
"""A state whose newest metrics line's mean loss is over this times the lowest is not resumed from: a healthy
run's line means stay within a few percent of their trend, and a doubled loss is a spike it has not come
back from (well inside ``training.divergence_loss_factor``, which stops the run)."""
LOSS_NOISE_NATS = 0.25
"""A line's loss this far (nats) over the lowest is a climb, not line-to-line noise. A freshly initialised
model starts near ``ln(vocab)`` and its early lines wander a few hundredths of a nat either side of it; a
diverged one climbs by nats."""
LOWEST_LOSS_KEY = "lowest_loss"
LOSS_KEY = "loss"


@dataclass(kw_only=True)
class DivergenceWatch:
    max_skipped_steps: int
    loss_factor: float
    uniform_loss: float = math.inf
    """``ln(vocab)``: the loss of a uniform guess over the vocabulary (nats)."""
    skipped_in_a_row: int = 0
    lowest_loss: float = math.inf
    """The lowest line mean of the whole run (carried over a resume in the trainer state)."""
    last_loss: float = math.nan
    """The newest line's mean loss (NaN before the stage's first line)."""

    @classmethod
    def from_config(cls, config: ConaConfig, trainer_state: dict[str, Any] | None = None) -> DivergenceWatch:
        """The watch of a stage; ``trainer_state``: that of the checkpoint it resumes from (its losses)."""
        saved = trainer_state or {}
        lowest, last = saved.get(LOWEST_LOSS_KEY), saved.get(LOSS_KEY)
        return cls(
            max_skipped_steps=config.training.runtime.max_skipped_steps,
            loss_factor=config.training.runtime.divergence_loss_factor,
            uniform_loss=math.log(config.model.padded_vocab_size),
            lowest_loss=float(lowest) if isinstance(lowest, int | float) else math.inf,
            last_loss=float(last) if isinstance(last, int | float) else math.nan,
        )

    def trainer_state(self) -> dict[str, float | None]:
        """The losses a checkpoint's trainer state records (None: no line yet)."""
        return {
            LOWEST_LOSS_KEY: self.lowest_loss if math.isfinite(self.lowest_loss) else None,
            LOSS_KEY: self.last_loss if math.isfinite(self.last_loss) else None,
        }

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
                self.last_loss = loss
                raise TrainingDiverged(f"training diverged at iteration {iteration}: the loss is {loss}")
            return  # only skipped steps: counted above
        self.last_loss = loss
        if self.loss_factor and loss > self.loss_factor * self.lowest_loss:
            raise TrainingDiverged(
                f"training diverged at iteration {iteration}: mean loss {loss:.4g} is over "
                f"{self.loss_factor:g}x the lowest so far ({self.lowest_loss:.4g}; "
                "training.divergence_loss_factor); lower training.base_lr"
            )
        self.lowest_loss = min(self.lowest_loss, loss)

    def unfit_to_resume(self) -> str | None:
        """Why the current state must not become the checkpoint a rerun resumes from (None: it may): the
        newest line's loss is not finite, over :data:`RESUME_LOSS_FACTOR` x the lowest, or above
        ``ln(vocab)`` after the run was below it and more than :data:`LOSS_NOISE_NATS` over the lowest."""
        loss, lowest = self.last_loss, self.lowest_loss
        if math.isnan(loss) and not math.isfinite(lowest):
            return None  # no line yet, in this stage or before it
        if not math.isfinite(loss):
            return f"its loss is {loss}"
        if loss > RESUME_LOSS_FACTOR * lowest:
            return f"its loss {loss:.4g} is over {RESUME_LOSS_FACTOR:g}x the lowest so far ({lowest:.4g})"
        if lowest < self.uniform_loss < loss and loss - lowest > LOSS_NOISE_NATS:
            return (
                f"its loss {loss:.4g} is above ln(vocab) = {self.uniform_loss:.4g} (a uniform guess), "
                f"which the run was below ({lowest:.4g})"
            )
        return None
