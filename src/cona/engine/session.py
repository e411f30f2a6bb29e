"""The worker side of a session: consecutive stages in the same processes (:mod:`cona.runner.worker_session`
is the runner side).

A session worker is started as ``python -m cona.engine.worker SPEC --session DIR``. After each stage every
rank drops the stage's objects, rank 0 writes ``DIR/done-<k>.json`` once all ranks got there, and every
rank waits for the runner's ``DIR/next-<k+1>.json``: ``{"spec": PATH, "written_at": T}`` runs that stage,
``{"stop": true}`` ends the session. Commands are files (written by the runner through a temporary name) so
that the protocol needs nothing beyond the run directory. A rank whose runner (``CONA_RUNNER_PID``) or
torchrun is gone stops waiting and exits 1, so a killed runner never leaves workers behind; during training
rank 0 checks the same about once a second (:class:`RunnerWatch`, agreed through the trainer's switch check).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from cona.atomic_files import write_json_atomic
from cona.config import ConaConfig
from cona.engine.session_files import done_marker, next_command
from cona.engine.spec import RUNNER_PID_ENV, StageSpec
from cona.processes import running

COMMAND_POLL_S = 0.03
RUNNER_CHECK_S = 1.0
"""How often rank 0 checks during training that the runner and torchrun are still there."""


def next_stage(spec: StageSpec, session_dir: Path, number: int, rank: int, *, keep_state: bool) -> dict:
    """Between two stages of a session: drop the finished stage's objects (unless it handed its state over
    to the next stage: ``keep_state``), say it is done (rank 0, once every rank got there), and wait for the
    runner's next command. Exits 1 when the runner is gone."""
    if not keep_state:
        release_stage_memory(spec.config)
    dist.barrier()
    if rank == 0:
        write_json_atomic(done_marker(session_dir, number), {"stage": spec.stage, "time": time.time()})
    runner_pid = int(os.environ.get(RUNNER_PID_ENV, "0"))
    command = wait_for_command(next_command(session_dir, number + 1), runner_pid=runner_pid)
    if command is None:
        leave_orphaned(runner_pid, "leaving the session")
    return command


def leave_orphaned(runner_pid: int, doing: str) -> NoReturn:
    """Exit 1 at once (no save, no metrics line): the runner that started this worker is gone."""
    print(f"runner pid {runner_pid} or torchrun is gone: {doing}", file=sys.stderr)
    sys.stderr.flush()
    os._exit(1)


class RunnerWatch:
    """Rank 0's check during training that its runner (``CONA_RUNNER_PID``) and this process's parent
    (torchrun) are still there: at most once per ``interval_s``, on the host alone (no device sync), so a
    killed runner's workers stop within seconds instead of training the stage to its end."""

    def __init__(self, runner_pid: int, *, interval_s: float = RUNNER_CHECK_S) -> None:
        self.runner_pid, self.interval_s = runner_pid, interval_s
        self._parent = os.getppid()
        self._next = time.monotonic() + interval_s

    @classmethod
    def from_env(cls) -> RunnerWatch | None:
        """The watch of a worker a runner started; None without ``CONA_RUNNER_PID``."""
        runner_pid = int(os.environ.get(RUNNER_PID_ENV, "0") or 0)
        return cls(runner_pid) if runner_pid > 0 else None

    def runner_gone(self) -> bool:
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + self.interval_s
        return os.getppid() != self._parent or not running(self.runner_pid)


def wait_for_command(path: Path, *, runner_pid: int, poll_s: float = COMMAND_POLL_S) -> dict | None:
    """The runner's command once ``path`` appears; None as soon as the runner process or this process's
    parent (torchrun) is gone, so a killed runner leaves no worker waiting for ever."""
    parent = os.getppid()
    while True:
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            pass
        if os.getppid() != parent or not running(runner_pid):
            return None
        time.sleep(poll_s)


def release_stage_memory(config: ConaConfig) -> None:
    """Free what the finished stage held (its model, optimizer and data are unreachable by now): the
    next stage has other shapes, so cached CUDA blocks and compiled graphs would only be in its way."""
    gc.collect()
    if config.training.runtime.compile is not False:  # on by default on a GPU
        torch._dynamo.reset()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
