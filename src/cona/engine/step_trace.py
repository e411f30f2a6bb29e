"""What each rank really trained on, step by step: a debug log that tests switch on.

With ``CONA_STEP_TRACE=1`` in the workers' environment, every rank appends one JSON line per training
step to ``<stage_dir>/steps/rank<r>.jsonl``: the iteration the step ends at, the global sample ids it
collated (in micro-batch order), and the learning rate of every optimizer group as the step applied it.
End-to-end tests read these lines (:func:`read_step_trace`) instead of rebuilding the ids from the logged
``consumed_samples`` with the sampler itself, so a trainer that skips or repeats samples at a gbs change,
or ignores the LR factor of its stage, is seen doing so. Off (the default) it costs one ``None`` check per
step; on, a line per step and rank, flushed at once so a killed attempt leaves what it trained.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np

from cona import run_files
from cona.jsonl import read_lines

STEP_TRACE_ENV = "CONA_STEP_TRACE"
TRACE_DIR = run_files.STEP_TRACE_DIR


@dataclass(frozen=True, kw_only=True)
class TracedStep:
    """One rank's record of one step."""

    iteration: int
    rank: int
    dp_rank: int
    stage: int
    sample_ids: tuple[int, ...]
    lrs: tuple[float, ...]
    """The LR of each optimizer parameter group after the step (all equal unless a bug split them)."""
    time: float
    pid: int


class StepTrace:
    """Appends this rank's step records to ``<stage_dir>/steps/rank<r>.jsonl``."""

    def __init__(self, stage_dir: Path, *, rank: int, dp_rank: int, stage: int) -> None:
        directory = stage_dir / TRACE_DIR
        directory.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] = open(directory / f"rank{rank}.jsonl", "a", buffering=1)  # noqa: SIM115
        self._fields = {"rank": rank, "dp_rank": dp_rank, "stage": stage, "pid": os.getpid()}

    def record(self, *, iteration: int, micro_batches: Iterable[np.ndarray], lrs: Iterable[float]) -> None:
        ids = [int(i) for batch in micro_batches for i in np.asarray(batch).ravel()]
        line = {"iteration": iteration, **self._fields, "sample_ids": ids, "lrs": [float(lr) for lr in lrs]}
        self._file.write(json.dumps({**line, "time": time.time()}) + "\n")

    def close(self) -> None:
        self._file.close()


def step_trace_from_env(stage_dir: Path, *, rank: int, dp_rank: int, stage: int) -> StepTrace | None:
    """A trace when ``CONA_STEP_TRACE=1`` is set for the workers, else None."""
    if os.environ.get(STEP_TRACE_ENV) != "1":
        return None
    return StepTrace(stage_dir, rank=rank, dp_rank=dp_rank, stage=stage)


def read_step_trace(run_dir: Path) -> list[TracedStep]:
    """Every record of every stage and attempt under ``run_dir``, in the order they were written."""
    steps = []
    for path in sorted(Path(run_dir).glob(f"{run_files.STAGES}/*/{TRACE_DIR}/rank*.jsonl")):
        for line in read_lines(path):
            if line.error is not None:
                raise line.error  # the trace is for tests: a torn line is a bug to see
            raw = line.value
            raw["sample_ids"], raw["lrs"] = tuple(raw["sample_ids"]), tuple(raw["lrs"])
            steps.append(TracedStep(**raw))
    return sorted(steps, key=lambda step: step.time)


@dataclass(frozen=True, kw_only=True)
class TrainedStep:
    """One iteration as the run finally trained it: every dp rank's ids, and the LR applied."""

    iteration: int
    stage: int
    sample_ids: tuple[int, ...]
    """The ids of all dp ranks, sorted."""
    lr: float


def effective_steps(records: list[TracedStep]) -> list[TrainedStep]:
    """Each iteration as it stands after every attempt: for an iteration trained more than once (a rerun
    after a kill), each rank's last record. Ranks that share a dp rank (tp, pp) must agree, and so must the
    LR groups; a disagreement is an error, not something to average away."""
    latest = {(record.iteration, record.rank): record for record in records}  # time order: later wins
    by_iteration: dict[int, dict[int, TracedStep]] = {}
    lrs_of: dict[int, set[float]] = {}
    for (iteration, _), record in sorted(latest.items()):
        lrs_of.setdefault(iteration, set()).update(record.lrs)
        seen = by_iteration.setdefault(iteration, {}).setdefault(record.dp_rank, record)
        if seen.sample_ids != record.sample_ids:
            raise AssertionError(
                f"iteration {iteration}: ranks {seen.rank} and {record.rank} of dp rank {record.dp_rank} "
                f"trained on different samples"
            )
    steps = []
    for iteration, ranks in sorted(by_iteration.items()):
        lrs = lrs_of[iteration]
        if len(lrs) != 1:
            raise AssertionError(f"iteration {iteration}: the optimizer groups applied LRs {sorted(lrs)}")
        ids = sorted(i for record in ranks.values() for i in record.sample_ids)
        stage = next(iter(ranks.values())).stage
        steps.append(TrainedStep(iteration=iteration, stage=stage, sample_ids=tuple(ids), lr=lrs.pop()))
    return steps
