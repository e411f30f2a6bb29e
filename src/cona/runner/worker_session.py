"""Consecutive stages on the same processes: a :data:`~cona.runner.stage_run.Launcher` that keeps torchrun
and its workers between stages of one topology instead of starting them again for every stage.

Starting the workers costs every process a Python and torch import (about 10 s for 4 processes on 2 CPU
cores), which a chain would otherwise pay at every switch. A :class:`WorkerSession` starts torchrun once
with ``--session DIR`` (:mod:`cona.engine.worker`; ``DIR`` is ``<run_dir>/session-<n>/``) and hands it
each later stage through ``DIR/next-<k>.json``; the workers answer ``DIR/done-<k>.json`` once the stage
saved, wrote its result and dropped its objects. The switch still goes through the checkpoint (save,
publish, load under the new layout, verification): only the processes and their default process group are
kept, with the port of the session's first stage (the free port its torchrun picked, unless the run has a
``--master-port-base``).

Every stage of a session gets its own ``stages/<N>/pids.json`` naming the same torchrun pid (with
``"session"``: the directory), completed with ``"ended"`` and return code 0 once the stage is done, so
``cona status`` never reads a finished stage as running. torchrun's output goes to the ``torchrun.log`` of
the stage that started the session. A stage on another topology (or after the session ended) stops the
session and starts a new one; a run across nodes starts every stage anew (:func:`launch.run_stage`).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO

from cona import run_files
from cona.atomic_files import write_json_atomic
from cona.engine.session_files import SESSION_FLAG, done_marker, next_command
from cona.errors import LaunchError
from cona.runner.launch import (
    WORKER_MODULE,
    check_port_free,
    clear_errors,
    describe_failure,
    launch_env,
    record_exit,
    record_pids,
    start_torchrun,
    stop_process,
    torchrun_command,
)
from cona.runner.stage_run import Launcher, StageLaunch, torchrun_launcher

SESSION_PREFIX = run_files.SESSION_PREFIX
_POLL_S = 0.02
_WATCH_INTERVAL_S = 0.5
_STOP_GRACE_S = 60.0
"""How long the workers get to leave the process group and exit after ``{"stop": true}``."""


@dataclass(frozen=True, kw_only=True)
class _Shape:
    """What a stage must share with the session to run in it (its master port need not: the session
    keeps the port of its first stage)."""

    nproc_per_node: int
    master_addr: str
    device_type: str
    quiet: bool

    @classmethod
    def of(cls, launch: StageLaunch) -> _Shape:
        topology = launch.topology
        return cls(
            nproc_per_node=topology.nproc_per_node,
            master_addr=topology.master_addr,
            device_type=launch.device_type,
            quiet=launch.quiet,
        )


@dataclass(kw_only=True)
class _Running:
    """One started session: torchrun, its directory and log, and how many stages it was given."""

    shape: _Shape
    process: subprocess.Popen
    directory: Path
    torchrun_log: Path
    log_handle: IO[str]
    stages: int = 1


class WorkerSession:
    """A launcher (``session(launch)``) that runs consecutive single-node stages of the same topology in
    the same worker processes. ``close()`` (or leaving its ``with`` block) stops them."""

    keeps_workers = True
    """Consecutive stages run in the same processes, so a stage can hand its state to the next in place."""

    def __init__(self, *, worker_module: str = WORKER_MODULE, env: Mapping[str, str] | None = None) -> None:
        self._worker_module, self._env = worker_module, env
        self._running: _Running | None = None

    def __call__(self, launch: StageLaunch) -> None:
        if launch.topology.nnodes > 1:
            self.close()
            torchrun_launcher(launch, worker_module=self._worker_module, env=self._env)
            return
        running = self._running
        if running is not None and (running.shape != _Shape.of(launch) or running.process.poll() is not None):
            self.close()
            running = None
        if running is None:
            running = self._start(launch)
        else:
            running.stages += 1
            write_json_atomic(
                next_command(running.directory, running.stages),
                {"spec": str(launch.spec_path), "written_at": time.time()},
            )
        self._wait_for_stage(running, launch)

    def _start(self, launch: StageLaunch) -> _Running:
        topology, stage_dir = launch.topology, launch.spec.stage_dir
        check_port_free(topology.master_port)
        clear_errors(stage_dir, topology)
        directory = _new_session_dir(launch.spec.run_dir)
        command = torchrun_command(
            launch.spec_path,
            topology,
            worker_module=self._worker_module,
            worker_args=(SESSION_FLAG, str(directory)),
        )
        env = launch_env(self._env, topology, device_type=launch.device_type, quiet=launch.quiet)
        log_path = stage_dir / topology.torchrun_log
        log_handle = open(log_path, "w")  # noqa: SIM115 (open as long as the session; closed in close())
        process = start_torchrun(command, env, log_handle, quiet=launch.quiet)
        self._running = _Running(
            shape=_Shape.of(launch),
            process=process,
            directory=directory,
            torchrun_log=log_path,
            log_handle=log_handle,
        )
        return self._running

    def _wait_for_stage(self, running: _Running, launch: StageLaunch) -> None:
        """Until the workers report the stage done; a stage whose workers failed raises
        :class:`LaunchError` as :func:`launch.run_stage` does (and ends the session)."""
        topology, stage_dir = launch.topology, launch.spec.stage_dir
        clear_errors(stage_dir, topology)
        pids_path = record_pids(
            stage_dir / topology.pids_file, topology, running.process.pid, session=str(running.directory)
        )
        done = done_marker(running.directory, running.stages)
        try:
            returncode = _wait(running.process, done, launch.watch)
        except BaseException:
            self._discard(running, stop=True)
            record_exit(pids_path, running.process.returncode)
            raise
        if returncode is None:
            record_exit(pids_path, 0)  # the stage ended; its processes wait for the next one
            return
        self._discard(running, stop=False)
        record_exit(pids_path, returncode)
        raise LaunchError(describe_failure(stage_dir, returncode, torchrun_log=str(running.torchrun_log)))

    def close(self) -> None:
        """Tell the workers to leave and wait for them (stopping them after a grace period)."""
        running = self._running
        if running is None:
            return
        if running.process.poll() is None:
            write_json_atomic(next_command(running.directory, running.stages + 1), {"stop": True})
            try:
                running.process.wait(timeout=_STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                stop_process(running.process)
        self._discard(running, stop=False)

    def _discard(self, running: _Running, *, stop: bool) -> None:
        if stop and running.process.poll() is None:
            stop_process(running.process)
        running.log_handle.close()
        shutil.rmtree(running.directory, ignore_errors=True)
        self._running = None

    def __enter__(self) -> WorkerSession:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if error is None:
            self.close()
        elif self._running is not None:
            self._discard(self._running, stop=True)  # failing: no point in a clean goodbye


@contextmanager
def stage_launcher(*, restart_workers: bool) -> Iterator[Launcher]:
    """The launcher of a chain or online run: a :class:`WorkerSession`, or with ``restart_workers`` a
    fresh torchrun for every stage; whatever it started has stopped when the block ends."""
    if restart_workers:
        yield torchrun_launcher
        return
    with WorkerSession() as session:
        yield session


def _wait(process: subprocess.Popen, done: Path, watch: Callable[[], None] | None) -> int | None:
    """None once ``done`` appears; torchrun's return code if it exits first. Calls ``watch`` about twice
    a second meanwhile."""
    next_watch = time.monotonic()
    while not done.exists():
        returncode = process.poll()
        if returncode is not None:
            return None if done.exists() else returncode
        if watch is not None and time.monotonic() >= next_watch:
            watch()
            next_watch = time.monotonic() + _WATCH_INTERVAL_S
        time.sleep(_POLL_S)
    return None


def _new_session_dir(run_dir: Path) -> Path:
    """``<run_dir>/session-<n>`` with the first unused n (a new, empty directory: no stale markers)."""
    number = 1
    while True:
        directory = run_dir / f"{SESSION_PREFIX}{number}"
        try:
            directory.mkdir(parents=True)
        except FileExistsError:
            number += 1
            continue
        return directory
