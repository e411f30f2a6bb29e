"""The runner's side of an in-place switch through Megatron-DeepSpeed: the processes a stage handed over.

A stage that hands over in place (``launched/cona_in_place.py`` is the processes' side) leaves its
``deepspeed`` launcher running: its last rank printed ``cona handover | iteration N`` and every rank waits
for ``<run_dir>/mds_handover/continue-<N>.json``. :class:`HeldLaunch` keeps that process (and the rest of
its output, read on by the next stage) until the next stage, planned to continue in place at iteration N,
writes its :func:`continue_command` there; a stage that does not continue it stops it.

Only a gbs change is done in place (:data:`IN_PLACE_MBS` False): DeepSpeed's ``set_train_batch_size`` keeps
the micro-batch size, and Megatron's sampler and the pipeline's buffers are built for one.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from cona import run_files
from cona.atomic_files import write_json_atomic
from cona.backends.megatron_deepspeed.launched.cona_in_place import command_path
from cona.engine.optim import LRSchedule
from cona.errors import LaunchError
from cona.strategy import Strategy

IN_PLACE_MBS = False
"""Whether an in-place switch of this backend may change mbs (the native engine's may)."""
_STOP_GRACE_S = 30.0


def handover_dir(run_dir: Path) -> Path:
    """Where the continue commands of the run's current launch go (emptied at every launch)."""
    return Path(run_dir) / run_files.MDS_HANDOVER


def fresh_handover_dir(run_dir: Path) -> Path:
    """The directory, emptied: a command of an earlier launch must never reach a new one."""
    directory = handover_dir(run_dir)
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    return directory


def continue_command(
    *,
    stage: int,
    strategy: Strategy,
    schedule: LRSchedule,
    train_tokens: int | None,
    stop_iteration: int | None,
    hand_over_at_stop: bool,
) -> dict:
    """What the waiting processes apply before the stage's first step (see ``cona_in_place``)."""
    return {
        "stage": stage,
        "gbs": strategy.gbs,
        "mbs": strategy.mbs,
        "lr": schedule.peak_lr,
        "min_lr": schedule.min_lr,
        "warmup_tokens": schedule.warmup_tokens,
        "decay_tokens": schedule.decay_tokens,
        "train_tokens": train_tokens,
        "stop_iteration": stop_iteration,
        "hand_over_at_stop": hand_over_at_stop,
        "written_at": time.time(),
    }


@dataclass(kw_only=True)
class Held:
    """A launch whose stage handed over at ``iteration``: its processes wait for the continue command."""

    process: subprocess.Popen
    strategy: Strategy
    iteration: int
    directory: Path


class HeldLaunch:
    """At most one held launch per run (the backend's, between two stages)."""

    def __init__(self) -> None:
        self.held: Held | None = None

    def keep(self, held: Held) -> None:
        self.stop()
        self.held = held

    def take(self, *, iteration: int | None, strategy: Strategy, stage: int) -> Held:
        """The held launch a stage continues at ``iteration`` with ``strategy`` (refused unless it waits
        there and only the gbs changes)."""
        held, self.held = self.held, None
        if held is None or held.process.poll() is not None:
            raise LaunchError(f"stage {stage}: continue_in_place, but no Megatron-DeepSpeed launch waits")
        if held.iteration != iteration or not held.strategy.same_layout(strategy, keep_mbs=True):
            held.process.kill()
            held.process.wait()
            raise LaunchError(
                f"stage {stage}: the waiting launch handed over {held.strategy.short()} at iteration "
                f"{held.iteration}; it cannot continue as {strategy.short()} from iteration {iteration}"
            )
        return held

    def stop(self) -> None:
        """Stop a held launch that no stage continues (SIGTERM: DeepSpeed's launcher ends its ranks)."""
        held, self.held = self.held, None
        if held is None or held.process.poll() is not None:
            return
        held.process.terminate()
        try:
            held.process.wait(timeout=_STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            held.process.kill()
            held.process.wait()


def send_command(held: Held, command: dict, record: Path) -> None:
    """Write the continue command the held processes wait for (and a copy in the stage directory)."""
    write_json_atomic(record, command)
    write_json_atomic(Path(command_path(str(held.directory), held.iteration)), command)
