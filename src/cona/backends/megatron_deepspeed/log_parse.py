"""Megatron-DeepSpeed's stdout -> CONA's ``metrics.jsonl`` lines (:class:`cona.metrics_record.MetricsRecord`).

Megatron prints, on the last rank, one line per log interval::

    iteration        6/      18 | consumed samples: 24 | consumed tokens: 1536 | elapsed time per iteration
    (ms): 350.1 | learning rate: 1.000E-03 | global batch size:     4 | lm loss: 1.081321E+01 | loss scale:
    1.0 |
    grad norm: 0.797 | ... | number of skipped iterations:   0 | ...

and after an evaluation ``validation loss at iteration 10 | lm loss value: 1.08E+01 | lm loss PPL: ... |``
(``... at iteration N on K-sample draw from validation set`` / ``from test set`` at the end or with
``--skip-train``). A training record is held back until the next line that is not its evaluation, so that an
evaluation at the same iteration lands in that record (as the native engine writes it).

Megatron-DeepSpeed reports no gradient-noise-scale inputs; CONA's hooks in the launched processes
(``launched/cona_megatron_hooks.py``) print them just before the iteration line they belong to::

    cona gns | iteration 6 | small sqr: 1.2E-01 | big sqr: 3.4E-02 | small batch: 1 | big batch: 4 | ...

and they fill that record's ``gns_*`` keys (null where no such line came: a run without the hooks). The
hooks' ``cona stop | iteration N | reason: switch_requested`` line says why the stage left its loop.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cona.metrics_record import MetricsRecord
from cona.strategy import Strategy

_FIELD = re.compile(r"\s*([a-z][a-z ()/]*[a-z)]):\s*([-+0-9.eEna]+)\s*")
_ITERATION = re.compile(r"\biteration\s+(\d+)/\s*(\d+)\s*\|")
_EVALUATION = re.compile(
    r"validation loss at (?:iteration (\d+)(?: on (\d+)-sample draw from (validation|test) set)?|(.*?)) \|"
    r" lm loss value: ([-+0-9.eEnaif]+) \|"
)
_GNS = re.compile(r"cona gns \| iteration (\d+) \|")
_STOP = re.compile(
    r"cona stop \| iteration (\d+) \| consumed samples: (\d+) \| consumed tokens: (\d+) \| reason: ([a-z_]+)"
)
_HANDOVER = re.compile(r"cona handover \| iteration (\d+)")
GNS_KEYS = {
    "small sqr": "gns_small_sqr",
    "big sqr": "gns_big_sqr",
    "small batch": "gns_small_batch",
    "big batch": "gns_big_batch",
}
TRAIN_KEYS = {
    "consumed samples": "consumed_samples",
    "consumed tokens": "consumed_tokens",
    "elapsed time per iteration (ms)": "step_time_ms",
    "learning rate": "lr",
    "global batch size": "gbs",
    "lm loss": "loss",
    "grad norm": "grad_norm",
    "number of skipped iterations": "skipped",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Evaluation:
    """One evaluation line: the loss over ``samples`` samples of the validation or test draw."""

    iteration: int | None
    split: str
    """``validation`` (also for the per-interval evaluations during training) or ``test``."""
    samples: int | None
    loss: float


def parse_training_line(line: str) -> dict[str, float] | None:
    """The numbers of a per-interval training line (None for any other line)."""
    match = _ITERATION.search(line)
    if match is None or "lm loss:" not in line:
        return None
    values: dict[str, float] = {"iteration": int(match.group(1)), "train_iters": int(match.group(2))}
    for part in line[match.end() :].split("|"):
        field_match = _FIELD.fullmatch(part)
        if field_match and field_match.group(1) in TRAIN_KEYS:
            values[TRAIN_KEYS[field_match.group(1)]] = float(field_match.group(2))
    return values


def parse_gns_line(line: str) -> tuple[int, dict[str, float]] | None:
    """The iteration and ``gns_*`` values of a ``cona gns`` line (None for any other line)."""
    match = _GNS.search(line)
    if match is None:
        return None
    values: dict[str, float] = {}
    for part in line[match.end() :].split("|"):
        field_match = _FIELD.fullmatch(part)
        if field_match and field_match.group(1) in GNS_KEYS:
            values[GNS_KEYS[field_match.group(1)]] = float(field_match.group(2))
    return int(match.group(1)), values


@dataclass(frozen=True, kw_only=True, slots=True)
class Stop:
    """The hooks' ``cona stop`` line: where and why the stage left Megatron's loop."""

    iteration: int
    consumed_samples: int
    consumed_tokens: int
    reason: str
    """``completed`` (its stop iteration), ``switch_requested`` or ``switch_in_place`` (the processes go on
    for the next stage: their ``cona handover`` line follows)."""


def parse_stop_line(line: str) -> Stop | None:
    match = _STOP.search(line)
    if match is None:
        return None
    iteration, samples, tokens = (int(match.group(index)) for index in (1, 2, 3))
    return Stop(iteration=iteration, consumed_samples=samples, consumed_tokens=tokens, reason=match.group(4))


def parse_handover_line(line: str) -> int | None:
    """The iteration of the hooks' ``cona handover | iteration N`` line: the stage's output ended there, its
    processes wait for the next stage (None for any other line)."""
    match = _HANDOVER.search(line)
    return int(match.group(1)) if match else None


def parse_evaluation_line(line: str) -> Evaluation | None:
    match = _EVALUATION.search(line)
    if match is None:
        return None
    iteration, samples, split = match.group(1), match.group(2), match.group(3)
    return Evaluation(
        iteration=int(iteration) if iteration else None,
        split=split or "validation",
        samples=int(samples) if samples else None,
        loss=float(match.group(5)),
    )


@dataclass(kw_only=True)
class MetricsRecorder:
    """Turns the lines of one stage into records for ``write`` (the run's metrics logger)."""

    stage: int
    strategy: Strategy
    seq: int
    write: Callable[[dict[str, Any]], None]
    previous_iteration: int | None = None
    """The iteration of the last record (the stage's start iteration when it loads a checkpoint)."""
    evaluations: list[Evaluation] = field(default_factory=list)
    """Every evaluation line seen (switch verification reads the final draws)."""
    _pending: MetricsRecord | None = None
    _last: MetricsRecord | None = None

    @property
    def last(self) -> dict[str, Any] | None:
        """The newest training record (written or pending), as it is written."""
        return None if self._last is None else self._last.to_dict()

    stop: Stop | None = None
    """The hooks' stop line, when one came."""
    _gns: dict[int, dict[str, float]] = field(default_factory=dict)
    """Gradient-noise values waiting for their iteration's training line."""

    def feed(self, line: str) -> None:
        gns = parse_gns_line(line)
        if gns is not None:
            self._gns[gns[0]] = gns[1]
            return
        stop = parse_stop_line(line)
        if stop is not None:
            self.stop = stop
            return
        evaluation = parse_evaluation_line(line)
        if evaluation is not None:
            self.evaluations.append(evaluation)
            pending = self._pending
            during_training = evaluation.samples is None  # the final draws name their size and split
            if pending is not None and during_training and evaluation.iteration == pending.iteration:
                self._pending = self._last = pending.with_evaluation(evaluation.loss)
            return
        values = parse_training_line(line)
        if values is None:
            return
        self.flush()
        self._pending = self._last = self._record(values)

    def flush(self) -> None:
        """Write the held-back record (at the next training line and at the end of the stage)."""
        if self._pending is not None:
            self.write(self._pending.to_dict())
            self._pending = None

    def _record(self, values: dict[str, float]) -> MetricsRecord:
        iteration = int(values["iteration"])
        steps = iteration - self.previous_iteration if self.previous_iteration is not None else None
        self.previous_iteration = iteration
        strategy = self.strategy
        gbs = int(values.get("gbs", strategy.gbs))
        step_time = values["step_time_ms"] / 1000.0 if "step_time_ms" in values else math.nan
        gns = self._gns.pop(iteration, {})
        return MetricsRecord(
            backend="megatron-deepspeed",  # the planner predicts this run with that backend's profile
            stage=self.stage,
            iteration=iteration,
            consumed_samples=int(values["consumed_samples"]),
            consumed_tokens=int(values.get("consumed_tokens", values["consumed_samples"] * self.seq)),
            loss=values.get("loss", math.nan),
            lr=values.get("lr", math.nan),
            gbs=gbs,
            mbs=strategy.mbs,
            dp=strategy.dp,
            tp=strategy.tp,
            pp=strategy.pp,
            step_time_s=step_time,
            tokens_per_s=gbs * self.seq / step_time if step_time > 0 else math.nan,
            grad_norm=values.get("grad_norm", math.nan),
            gns_small_sqr=gns.get("gns_small_sqr"),
            gns_big_sqr=gns.get("gns_big_sqr"),
            gns_small_batch=int(gns["gns_small_batch"]) if "gns_small_batch" in gns else None,
            gns_big_batch=int(gns["gns_big_batch"]) if "gns_big_batch" in gns else None,
            steps_in_interval=steps,
            skipped_steps=values.get("skipped", 0.0),
            time=time.time(),
        )  # no mfu (Megatron reports none): written as null; gns_* from the hooks
