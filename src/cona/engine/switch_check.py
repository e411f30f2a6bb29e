"""Switch verification: the loss of one fixed probe batch before a save and after the next load must agree.

A stage that saves records the mean loss of a fixed probe batch (a few validation rows, the same whatever the
layout, gbs or mbs) in the checkpoint (``probe.json``, see
:func:`cona.engine.checkpoint.save.save_checkpoint`). The stage that loads it computes the loss of the same
batch before its first training step;
:func:`compare_probe` decides whether the two differ by more than float noise. A resharding bug (a tensor
concatenated along the wrong dimension, a fused QKV split at the wrong place) or a damaged shard moves that
loss by far more than the noise, so it stops the run before it trains on wrong weights. A weight the probe
batch hardly reaches (an embedding row of a token it does not hold) may move the loss by nothing, so the
record also holds each model tensor's largest magnitude (``tensor_max_abs``, the L-infinity norm, which a
replicated shard cannot count twice): after the load every tensor must be finite and have the saved value
within the same relative tolerance.

This module is pure (no torch), so every backend can use it: the native engine measures the probe with
:meth:`cona.engine.train_model.TrainingModel.probe_loss`; another backend measures its own and compares
with the same function. The verdict of a stage's check is written to ``stages/<N>/switch_check.json`` by
its rank 0, so the runner can report a refused switch in one line.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from cona import run_files
from cona.atomic_files import write_json_atomic
from cona.errors import CheckpointError

VERDICT_FILE = run_files.SWITCH_CHECK

PROBE_RTOL: dict[str, float] = {
    # Two layouts compute the same forward pass with the sums in another order (tp partial sums, pipeline
    # stages, other GEMM tilings), so the probe losses differ by rounding alone; the tolerance is a relative
    # bound on that, per compute dtype.
    # fp32 (24-bit significand, eps 1.2e-7): the engine's parity tests measure layout differences of the
    # probe loss around 1e-7 relative; 2e-5 leaves two orders of magnitude for deeper models and other
    # kernels and still flags a damaged tensor (a single permuted or rescaled weight matrix moves the loss
    # by 1e-3 or more).
    "fp32": 2e-5,
    # fp16 (11-bit significand, eps 9.8e-4): each GEMM output is rounded at ~5e-4 relative, differently per
    # layout; the mean over the probe's tokens averages most of it away. 5 eps.
    "fp16": 5e-3,
    # bf16 (8-bit significand, eps 7.8e-3): as fp16 with 8x coarser rounding. 2.5 eps.
    "bf16": 2e-2,
}
PROBE_ATOL = 1e-6
"""Absolute floor, so a loss near zero does not demand a relative precision no dtype has."""
Status = Literal["passed", "failed", "skipped"]


@dataclass(frozen=True, kw_only=True)
class ProbeRecord:
    """The probe loss of one model state under one layout, and what identifies the batch it was taken on."""

    loss: float
    dtype: str
    """The compute dtype the loss was measured in (``fp32``, ``bf16``, ``fp16``)."""
    layout: str
    """The strategy, as :meth:`cona.strategy.Strategy.short` writes it."""
    iteration: int
    split: str
    """The dataset split the rows come from (``valid``; ``test`` or ``train`` when it has no samples)."""
    sample_ids: tuple[int, ...]
    tokens_sha256: str
    """Hash of the batch's token rows: equal hashes mean the same batch, whatever the data files."""
    seconds: float
    """What measuring the probe cost (wall clock, on rank 0)."""
    tensor_max_abs: dict[str, float] | None = None
    """Each model tensor's largest magnitude by its checkpoint name (None: not measured, as by an older
    cona or another backend)."""

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "sample_ids": list(self.sample_ids)}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ProbeRecord:
        names = {field.name for field in dataclasses.fields(cls)}
        missing = names - raw.keys() - {"tensor_max_abs"}
        if missing:
            raise CheckpointError(f"probe record lacks {', '.join(sorted(missing))}")
        values = {name: raw.get(name) for name in names}
        return cls(**{**values, "sample_ids": tuple(int(i) for i in values["sample_ids"])})

    def same_batch(self, other: ProbeRecord) -> bool:
        return (self.split, self.sample_ids, self.tokens_sha256) == (
            other.split,
            other.sample_ids,
            other.tokens_sha256,
        )


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """The outcome of comparing the probe saved with a checkpoint and the probe after loading it."""

    status: Status
    checkpoint: str
    saved: ProbeRecord | None
    loaded: ProbeRecord | None
    difference: float | None = None
    """|loaded loss - saved loss|."""
    tolerance: float | None = None
    """The largest difference accepted (absolute, from :func:`probe_tolerance` of both losses)."""
    reason: str = ""
    """Why it was skipped, or failed without a comparison (empty when the losses were compared)."""

    @property
    def passed(self) -> bool:
        return self.status != "failed"

    def message(self) -> str:
        """One line that says what was compared and what came out."""
        if self.status == "skipped":
            return f"switch check skipped for {self.checkpoint}: {self.reason}"
        if self.reason:
            return f"switch verification refused checkpoint {self.checkpoint}: {self.reason}"
        assert self.saved is not None and self.loaded is not None
        saved, loaded = self.saved, self.loaded
        compared = (
            f"probe loss {saved.loss:.8g} saved under {saved.layout} ({saved.dtype}, iteration "
            f"{saved.iteration}), {loaded.loss:.8g} after loading under {loaded.layout} ({loaded.dtype})"
        )
        if self.status == "passed":
            return (
                f"switch check passed for {self.checkpoint}: {compared}; difference {self.difference:.3g} "
                f"<= tolerance {self.tolerance:.3g}"
            )
        return (
            f"switch verification refused checkpoint {self.checkpoint}: {compared}; they differ by "
            f"{self.difference:.6g}, more than float noise allows ({self.tolerance:.3g}): the weights did "
            f"not survive the hand-off. No training step was taken and the checkpoint is left as it is"
        )

    def to_dict(self) -> dict[str, Any]:
        values = dataclasses.asdict(self)
        values["saved"] = self.saved.to_dict() if self.saved else None
        values["loaded"] = self.loaded.to_dict() if self.loaded else None
        return values

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Verdict:
        values = dict(raw)
        for key in ("saved", "loaded"):
            values[key] = ProbeRecord.from_dict(values[key]) if values.get(key) else None
        return cls(**values)


def probe_tolerance(loss_a: float, loss_b: float, dtypes: tuple[str, ...]) -> float:
    """The largest float-noise difference between two probe losses measured in ``dtypes`` (the loosest
    dtype decides: a checkpoint saved in bf16 and loaded in fp32 carries bf16's rounding)."""
    unknown = [dtype for dtype in dtypes if dtype not in PROBE_RTOL]
    if unknown:
        raise CheckpointError(f"switch check: no probe tolerance for dtype {unknown[0]!r}")
    rtol = max(PROBE_RTOL[dtype] for dtype in dtypes)
    return rtol * max(abs(loss_a), abs(loss_b)) + PROBE_ATOL


def compare_probe(before: ProbeRecord | None, after: ProbeRecord, *, checkpoint: str) -> Verdict:
    """Compare the probe saved with ``checkpoint`` (``before``; None if it recorded none) with the probe
    measured right after loading it (``after``).

    Skipped (not failed) when the checkpoint records no probe (one saved by an older cona or another tool).
    Failed when the batch is not the one saved (its tokens differ: the data files changed under the run,
    so the weights cannot be verified and the run would not continue on the same data anyway), when a
    model tensor's largest magnitude is not finite or not the saved one (:func:`tensor_mismatch`), when
    either loss is not finite, or when they differ by more than :func:`probe_tolerance`.
    """
    if before is None:
        return Verdict(
            status="skipped",
            checkpoint=checkpoint,
            saved=None,
            loaded=after,
            reason="the checkpoint records no probe loss",
        )
    if not before.same_batch(after):
        return Verdict(
            status="failed",
            checkpoint=checkpoint,
            saved=before,
            loaded=after,
            reason=(
                f"its probe batch ({before.split} samples {list(before.sample_ids)}, sha256 "
                f"{before.tokens_sha256[:12]}) is not in this run's data, which has {after.split} samples "
                f"{list(after.sample_ids)} with sha256 {after.tokens_sha256[:12]} there: the data files "
                f"changed since it was saved, so its weights cannot be verified. No training step was taken"
            ),
        )
    mismatch = tensor_mismatch(before, after)
    if mismatch is not None:
        return Verdict(status="failed", checkpoint=checkpoint, saved=before, loaded=after, reason=mismatch)
    difference = abs(after.loss - before.loss)
    tolerance = probe_tolerance(before.loss, after.loss, (before.dtype, after.dtype))
    finite = math.isfinite(before.loss) and math.isfinite(after.loss)
    return Verdict(
        status="passed" if finite and difference <= tolerance else "failed",
        checkpoint=checkpoint,
        saved=before,
        loaded=after,
        difference=difference if finite else math.inf,
        tolerance=tolerance,
    )


def tensor_mismatch(before: ProbeRecord, after: ProbeRecord) -> str | None:
    """Why the loaded tensors are not the saved ones (None: every tensor both records name is finite and
    has its saved largest magnitude within the loosest dtype's tolerance, or the save measured none). Only
    names both hold are compared: a layout may name a tied copy the other does not, and a tensor the
    checkpoint lacks fails its load before this."""
    saved, loaded = before.tensor_max_abs, after.tensor_max_abs
    if not saved or loaded is None:
        return None
    rtol = max(PROBE_RTOL.get(dtype, max(PROBE_RTOL.values())) for dtype in (before.dtype, after.dtype))
    for name in sorted(saved.keys() & loaded.keys()):
        value, now = saved[name], loaded[name]
        if not math.isfinite(now) or abs(now - value) > rtol * abs(value) + PROBE_ATOL:
            return (
                f"model tensor {name} holds values up to {now:.6g} in magnitude after loading, {value:.6g} "
                f"when saved: the weights did not survive the hand-off. No training step was taken"
            )
    return None


def write_verdict(stage_dir: Path, verdict: Verdict) -> Path:
    """``stages/<N>/switch_check.json`` (atomically, so a reader never sees half a file)."""
    path = Path(stage_dir) / VERDICT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_json_atomic(path, verdict.to_dict())


def read_verdict(stage_dir: Path, *, newer_than: float | None = None) -> Verdict | None:
    """The stage's verdict, if it has one (and, with ``newer_than``, written after that unix time)."""
    path = Path(stage_dir) / VERDICT_FILE
    try:
        if newer_than is not None and path.stat().st_mtime < newer_than:
            return None
        return Verdict.from_dict(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, TypeError, KeyError, CheckpointError):
        return None  # half a file of a killed worker: the stage failed for that reason, not this one
