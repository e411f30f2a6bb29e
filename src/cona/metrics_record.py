"""The schema of ``metrics.jsonl``: one :class:`MetricsRecord` per log interval of a stage.

Written by the native trainer (:mod:`cona.engine.trainer`, rank 0) and by the Megatron-DeepSpeed log parser
(:mod:`cona.backends.megatron_deepspeed.log_parse`); read by the online search, the console, ``cona status``
and ``cona report``, a resumed run's noise scale, and ``cona plan --trace`` (calibration and the trace). The
JSON keys are the field names and users read the file, so a rename here is a format change.

Reading is lenient: every field may be missing (an older line, a line a test or another tool wrote), and keys
this version does not know are kept in ``extra`` and written back after the known ones.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cona.jsonl import read_records

MASKED_TOKENS = "masked"
"""Value of ``eval_ppl_tokens`` when ``eval_ppl`` is BERT's masked-token perplexity (the key is absent for GPT
and Llama, whose perplexity covers every token)."""


@dataclass(frozen=True, kw_only=True)
class MetricsRecord:
    """One line of ``metrics.jsonl``: the means over the log interval that ends at ``iteration``."""

    stage: int | None = None
    iteration: int | None = None
    """The last iteration of the interval (the run's count, continued across stages)."""
    consumed_samples: int | None = None
    consumed_tokens: int | None = None
    loss: float | None = None
    """Mean training loss of the interval (null when it diverged to NaN or inf)."""
    lr: float | None = None
    gbs: int | None = None
    mbs: int | None = None
    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    step_time_s: float | None = None
    """Wall seconds per iteration over the interval (what the planner's calibration fits)."""
    tokens_per_s: float | None = None
    """``gbs * seq / step_time_s``: the throughput the online search measures the running strategy by."""
    mfu: float | None = None
    """Model FLOPs utilisation; null where the device's peak is unknown (a CPU) or the backend has none."""
    grad_norm: float | None = None
    gns_small_sqr: float | None = None
    """The noise-scale inputs (:mod:`cona.planner.efficiency`): mean ``|g|^2`` at the small and the big
    batch of the two-batch estimator, and those two batch sizes; null where not measured."""
    gns_big_sqr: float | None = None
    gns_small_batch: int | None = None
    gns_big_batch: int | None = None
    gns_steps: list[list[float]] | None = None
    """``[gns_small_sqr, gns_big_sqr]`` of each measured step of the interval, in order, written only where
    it had more than one (``gns_small_sqr`` and ``gns_big_sqr`` are their means): each is one measurement
    for the noise-scale tracker."""
    steps_in_interval: int | None = None
    first_step_s: float | None = None
    """Wall seconds of the stage's first step (the device synchronised after it), written only on the line
    that holds it: the line's other steps took ``step_time_s * steps_in_interval - first_step_s``. The first
    step holds the start-up (allocations, eager kernels' first run, a compile), so the rest of that line is
    the stage's first steady measurement; on the run's first line its steps measured the noise scale."""
    warmup_steps: int | None = None
    """Steps of the interval that still warmed up a forward shape (:mod:`cona.engine.shape_warmup`),
    written only where there were any: such a line is no steady rate."""
    skipped_steps: float | None = None
    """Steps the optimizer skipped (fp16 overflow); Megatron reports it as a float."""
    time: float | None = None
    """Unix time the line was written."""
    backend: str | None = None
    """Written first and only by a backend other than the native engine (``megatron-deepspeed``)."""
    eval_loss: float | None = None
    """Written only on a line with an evaluation, as are ``eval_ppl`` and ``eval_ppl_tokens``."""
    eval_ppl: float | None = None
    eval_ppl_tokens: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Keys of the line that are not fields of this version (kept, and written after the known ones)."""

    def to_dict(self) -> dict[str, Any]:
        """The line as JSON-ready values, in the order the writers always wrote them."""
        values: dict[str, Any] = {} if self.backend is None else {"backend": self.backend}
        values |= {name: getattr(self, name) for name in ALWAYS_WRITTEN}
        values |= {name: getattr(self, name) for name in WRITTEN_WHEN_SET if getattr(self, name) is not None}
        return values | dict(self.extra)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> MetricsRecord:
        """The record of a decoded line; ValueError naming the key when a known key has a value of the wrong
        JSON type (missing keys are None)."""
        known = {name: raw[name] for name in _FIELD_KINDS if name in raw}
        for name, value in known.items():
            _check_kind(name, value)
        return cls(**known, extra={key: value for key, value in raw.items() if key not in _FIELD_KINDS})

    def with_evaluation(self, loss: float, *, masked_tokens: bool = False) -> MetricsRecord:
        """This record with the evaluation at its iteration (``masked_tokens``: BERT's perplexity)."""
        return dataclasses.replace(
            self,
            eval_loss=loss,
            eval_ppl=eval_perplexity(loss),
            eval_ppl_tokens=MASKED_TOKENS if masked_tokens else None,
        )

    @property
    def after_first_step_s(self) -> float | None:
        """Seconds per step of this line's steps after the stage's first (None: the line does not hold the
        first step, or holds no other step)."""
        steps, step_s, first_s = self.steps_in_interval, self.step_time_s, self.first_step_s
        if first_s is None or step_s is None or steps is None or steps < 2:
            return None
        rest_s = (step_s * steps - first_s) / (steps - 1)
        return rest_s if rest_s > 0 else None

    @property
    def measured_steps(self) -> int:
        """Steps of the line that measured the noise-scale inputs."""
        if self.gns_steps is not None:
            return len(self.gns_steps)
        return int(self.gns_small_sqr is not None and math.isfinite(self.gns_small_sqr))

    @property
    def has_strategy(self) -> bool:
        return None not in (self.dp, self.tp, self.pp)


ALWAYS_WRITTEN = (
    "stage",
    "iteration",
    "consumed_samples",
    "consumed_tokens",
    "loss",
    "lr",
    "gbs",
    "mbs",
    "dp",
    "tp",
    "pp",
    "step_time_s",
    "tokens_per_s",
    "mfu",
    "grad_norm",
    "gns_small_sqr",
    "gns_big_sqr",
    "gns_small_batch",
    "gns_big_batch",
    "steps_in_interval",
    "skipped_steps",
    "time",
)
"""The keys of every line the trainer and the log parser write (null where unknown)."""
WRITTEN_WHEN_SET = ("gns_steps", "first_step_s", "warmup_steps", "eval_loss", "eval_ppl", "eval_ppl_tokens")

_NUMBER, _TEXT, _PAIRS = "number", "text", "pairs"
_FIELD_KINDS = {name: _NUMBER for name in ALWAYS_WRITTEN} | {
    "backend": _TEXT,
    "gns_steps": _PAIRS,
    "first_step_s": _NUMBER,
    "warmup_steps": _NUMBER,
    "eval_loss": _NUMBER,
    "eval_ppl": _NUMBER,
    "eval_ppl_tokens": _TEXT,
}


def _check_kind(name: str, value: Any) -> None:
    if value is None:
        return
    if _FIELD_KINDS[name] == _TEXT and not isinstance(value, str):
        raise ValueError(f"metrics record: {name} is {value!r}, not a string")
    if _FIELD_KINDS[name] == _NUMBER and not _is_number(value):
        raise ValueError(f"metrics record: {name} is {value!r}, not a number")
    if _FIELD_KINDS[name] == _PAIRS and not (
        isinstance(value, list)
        and all(isinstance(pair, list) and len(pair) == 2 and all(map(_is_number, pair)) for pair in value)
    ):
        raise ValueError(f"metrics record: {name} is {value!r}, not a list of number pairs")


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float)


def eval_perplexity(loss: float) -> float:
    """``exp(loss)``, inf past the float range (written as null: JSON has no inf)."""
    return math.exp(loss) if loss < 700 else math.inf


def read_metrics(path: Path) -> list[MetricsRecord]:
    """The records of a ``metrics.jsonl`` in file order; a line that is not a record (torn by a killed
    writer, a known key of the wrong type) is skipped. A missing file reads as empty."""
    return metrics_records(read_records(path))


def metrics_records(lines: Iterable[Mapping[str, Any]]) -> list[MetricsRecord]:
    """The decoded lines that are records (:class:`cona.jsonl.JsonlTail`'s, say), in order."""
    records = []
    for line in lines:
        try:
            records.append(MetricsRecord.from_dict(line))
        except ValueError:
            continue  # a known key of the wrong type: not a line CONA wrote
    return records


WARMUP_RATE_JUMP = 1.5
"""A stage's line after its first that ran this many times slower than the line after it is still warm-up."""


def stage_rates(records: Iterable[MetricsRecord]) -> list[float]:
    """The tokens/s of one stage's lines in order, for :func:`steady_rates`: after the stage's first line
    (which holds its start and which steady_rates drops), a line that still warmed up a forward shape
    (``warmup_steps``) is left out, whatever the lines after it show, and so is a last line shorter than
    the one before it. The switch (or the run's end) cut that one short after the search had decided: it
    ran no noise-measuring step, and eager it can run 1.6-1.7x faster than any full line: taken as the
    stage's rate it makes the stage look faster than it is, and a decision made on it is wrong."""
    records = list(records)
    if len(records) > 1 and (records[-1].steps_in_interval or 0) < (records[-2].steps_in_interval or 0):
        records = records[:-1]
    rates: list[float] = []
    for record in records:
        if record.tokens_per_s is not None and not (rates and record.warmup_steps):
            rates.append(float(record.tokens_per_s))
    return rates


def measured_tokens_per_s(records: Iterable[MetricsRecord]) -> float | None:
    """A stage's measured rate, as the policy takes it: the median of its steady lines' tokens/s
    (:func:`stage_rates`, then :func:`steady_rates`); None when it logged no steady line."""
    steady = sorted(steady_rates(stage_rates(records)))
    if not steady:
        return None
    middle = len(steady) // 2
    return steady[middle] if len(steady) % 2 else (steady[middle - 1] + steady[middle]) / 2


def steady_rates(rates: list[float]) -> list[float]:
    """The tokens/s of a stage's lines that measure its steady rate: the first line (start-up, the first
    step) left out, and after it each leading line :data:`WARMUP_RATE_JUMP` times slower than the next.
    Compiled, a new shape's graphs can warm up past the first line (a second line 2-3x slower than the
    third). Eager host-bound lines of one strategy scatter by up to about a third, so only a larger jump
    reads as warm-up, and only at the stage's start."""
    steady = rates[1:]
    while len(steady) > 1 and steady[0] * WARMUP_RATE_JUMP < steady[1]:
        steady = steady[1:]
    return steady
