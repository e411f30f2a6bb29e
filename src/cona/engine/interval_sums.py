"""What a metrics line reports about the steps since the previous one, kept on the device until the line.

Each step adds one small float64 row (loss, gradient norm, the two noise-scale inputs, whether they were
measured, whether the optimizer skipped the step); the line stacks the rows and reads them in one host
transfer, which is the one place the loop waits for the device. Keeping the rows, not only their sums,
gives the line every measured step's own noise-scale inputs: the noise-scale tracker counts measurements,
so a line whose steps were all measured (the run's first steps, see :func:`cona.engine.trainer.gns_due`)
brings as many measurements as it has steps, not one.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from cona.engine.step_output import PendingStepOutput

LOSS, GRAD_NORM, SMALL_SQR, BIG_SQR, MEASURED, SKIPPED = range(6)


@dataclass(kw_only=True)
class IntervalSums:
    """The steps since the last metrics line, as device rows (the line reports their means)."""

    rows: list[Tensor] = field(default_factory=list)
    """float64 [loss, grad_norm, gns_small_sqr, gns_big_sqr, gns_measured, skipped] per step. The GNS
    inputs count only where finite (the first step of a difference estimate, unmeasured steps and fp16
    overflows have none)."""
    last: PendingStepOutput | None = None
    warmup_steps: int = 0
    """Steps that still warmed up a forward shape (:mod:`cona.engine.shape_warmup`)."""
    started: float = field(default_factory=time.perf_counter)
    first_step_s: float | None = None
    """Seconds of the stage's first step, on the interval that holds it (see MetricsRecord.first_step_s)."""

    @property
    def steps(self) -> int:
        return len(self.rows)

    def add(
        self, out: PendingStepOutput, grad_norm: Tensor, stepped: Tensor, *, warmed_up: bool = False
    ) -> None:
        measured = torch.isfinite(out.gns_small_sqr) & torch.isfinite(out.gns_big_sqr)
        zero = torch.zeros_like(out.gns_small_sqr)
        values = [
            out.loss,
            grad_norm,
            torch.where(measured, out.gns_small_sqr, zero),
            torch.where(measured, out.gns_big_sqr, zero),
            measured,
            ~stepped,
        ]
        self.rows.append(torch.stack([v.to(torch.float64) for v in values]))
        self.last = out
        self.warmup_steps += warmed_up

    def means(self) -> dict[str, float | list[list[float]]]:
        """The interval's means (one host read, which waits for the device); GNS NaN if none measured.
        ``gns_steps`` lists each measured step's ``[gns_small_sqr, gns_big_sqr]`` in step order."""
        assert self.rows, "a metrics line always follows at least one step"
        rows = torch.stack(self.rows).tolist()
        measured = [[row[SMALL_SQR], row[BIG_SQR]] for row in rows if row[MEASURED]]
        count = len(measured)
        return {
            "loss": sum(row[LOSS] for row in rows) / len(rows),
            "grad_norm": sum(row[GRAD_NORM] for row in rows) / len(rows),
            "gns_small_sqr": sum(pair[0] for pair in measured) / count if count else math.nan,
            "gns_big_sqr": sum(pair[1] for pair in measured) / count if count else math.nan,
            "gns_steps": measured,
            "skipped_steps": int(sum(row[SKIPPED] for row in rows)),
        }
