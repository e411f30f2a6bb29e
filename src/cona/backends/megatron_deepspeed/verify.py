"""Switch verification for Megatron-DeepSpeed: the loss of the same evaluation draw before and after a switch.

Before: a stage stops by ``--train-tokens``, so Megatron leaves its loop normally, saves, and then evaluates
its
test draw (``eval_iters * gbs`` samples from the start of the test split, the same in every launch with the
same
``--train-samples``, gbs and eval_iters) and its validation draw (from the ``consumed_valid_samples`` the
checkpoint records). The stage's runner stores those losses beside the checkpoint
(``global_step<N>/cona_probe.json``).

After: before the next stage trains on the converted checkpoint, an evaluation-only launch (``--skip-train``)
loads it under the new layout with the same gbs (micro-batch 1, so any dp that divides gbs can take it) and
evaluates the same draws. :func:`cona.engine.switch_check.compare_probe` decides whether the two losses
differ by
more than float noise; a refusal stops the run before any step, and the checkpoint stays as it is.

A Megatron draw is identified by its definition, not by its token ids (which only Megatron's process sees):
``tokens_sha256`` of these records hashes the data prefix, split string, seed, sequence length, train samples,
gbs, eval iterations and the draw's name, and ``sample_ids`` is empty.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cona.atomic_files import write_json_atomic
from cona.backends.megatron_deepspeed.commands import ChainShape
from cona.backends.megatron_deepspeed.log_parse import Evaluation
from cona.config import ConaConfig
from cona.engine.switch_check import ProbeRecord, Verdict, compare_probe
from cona.errors import CheckpointError
from cona.strategy import Strategy

PROBE_FILE = "cona_probe.json"
DRAW_PREFERENCE = ("test", "validation")
"""The test draw starts at sample 0 in every launch; the validation draw depends on the checkpoint's
counters."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SavedProbe:
    """The "before" side: the draw's loss under the saving layout, and the batch shape that defines the
    draw."""

    record: ProbeRecord
    gbs: int
    eval_iters: int

    def to_dict(self) -> dict[str, Any]:
        return {"record": self.record.to_dict(), "gbs": self.gbs, "eval_iters": self.eval_iters}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SavedProbe:
        return cls(record=ProbeRecord.from_dict(raw["record"]), gbs=raw["gbs"], eval_iters=raw["eval_iters"])


def draw_digest(config: ConaConfig, shape: ChainShape, *, gbs: int, eval_iters: int, split: str) -> str:
    """What identifies a Megatron evaluation draw (see the module docstring)."""
    training = config.training
    definition = {
        "data_prefix": str(training.data.data_prefix),
        "split": training.data.split,
        "seed": training.runtime.seed,
        "seq": config.model.seq,
        "train_samples": shape.train_samples,
        "gbs": gbs,
        "eval_iters": eval_iters,
        "draw": split,
    }
    return hashlib.sha256(json.dumps(definition, sort_keys=True).encode()).hexdigest()


def probe_record(
    evaluations: Sequence[Evaluation],
    *,
    config: ConaConfig,
    shape: ChainShape,
    strategy: Strategy,
    eval_iters: int,
    dtype: str,
    seconds: float,
) -> ProbeRecord | None:
    """The record of a launch's final draw (test when the split has one, else validation); None when the
    launch
    printed no final evaluation (eval_iters 0, or it died)."""
    final = {evaluation.split: evaluation for evaluation in evaluations if evaluation.samples is not None}
    for split in DRAW_PREFERENCE:
        if split in final:
            evaluation = final[split]
            return ProbeRecord(
                loss=evaluation.loss,
                dtype=dtype,
                layout=strategy.short(),
                iteration=evaluation.iteration if evaluation.iteration is not None else -1,
                split=split,
                sample_ids=(),
                tokens_sha256=draw_digest(
                    config, shape, gbs=strategy.gbs, eval_iters=eval_iters, split=split
                ),
                seconds=seconds,
            )
    return None


def write_saved_probe(global_step_dir: Path, probe: SavedProbe) -> Path:
    path = Path(global_step_dir) / PROBE_FILE
    return write_json_atomic(path, probe.to_dict())


def read_saved_probe(universal_dir: Path) -> SavedProbe | None:
    """The probe saved with the checkpoint a universal directory was converted from (None if it has none)."""
    universal_dir = Path(universal_dir)
    source = universal_dir.with_name(universal_dir.name.removesuffix("_universal"))
    try:
        return SavedProbe.from_dict(json.loads((source / PROBE_FILE).read_text()))
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise CheckpointError(f"{source / PROBE_FILE}: not a probe record ({err})") from None


def probe_strategy(saved: SavedProbe, target: Strategy) -> Strategy | None:
    """The target layout evaluating the saved draw: the saved gbs, micro-batch 1 (None when the target's dp
    does
    not divide that gbs, so the draw cannot be evaluated under it)."""
    if saved.gbs % target.dp:
        return None
    return Strategy(
        dp=target.dp, tp=target.tp, pp=target.pp, mbs=1, gbs=saved.gbs, zero_stage=target.zero_stage
    )


def unmeasurable(saved: SavedProbe | None, checkpoint: str, why: str) -> Verdict:
    """A skipped verdict (nothing to compare), which the runner reports but does not refuse."""
    return Verdict(
        status="skipped",
        checkpoint=checkpoint,
        saved=saved.record if saved else None,
        loaded=None,
        reason=why,
    )


def verdict_of(saved: SavedProbe, loaded: ProbeRecord | None, *, checkpoint: str) -> Verdict:
    """Compare; a launch that printed no evaluation of the draw fails (it cannot vouch for the weights)."""
    if loaded is None:
        return Verdict(
            status="failed",
            checkpoint=checkpoint,
            saved=saved.record,
            loaded=None,
            reason="the evaluation-only launch under the new layout printed no loss of the saved draw",
        )
    return compare_probe(saved.record, loaded, checkpoint=checkpoint)


def verdict_line(verdict: Verdict) -> str:
    """Verdict.message() also for a failure with nothing loaded (which it does not describe)."""
    if verdict.status == "failed" and verdict.loaded is None:
        return f"switch verification refused checkpoint {verdict.checkpoint}: {verdict.reason}"
    return verdict.message()
