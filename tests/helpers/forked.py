"""Running a whole run in a forked child that a test's worker kills, for the SIGKILL end-to-end tests."""

from __future__ import annotations

import gc
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from cona.engine.spec import RUNNER_PID_ENV

CHILD_TIMEOUT_S = 480


def fork() -> int:
    """``os.fork()`` with the test process's objects kept out of the child's garbage collection: collected
    in a child, garbage that earlier tests had left (W&B's opentelemetry threads were running in the test
    process) once crashed it with a segmentation fault inside the run (:func:`gc.freeze`, as Python's
    documentation advises for a fork without exec)."""
    gc.collect()
    gc.freeze()
    pid = os.fork()
    if pid:
        gc.unfreeze()
    return pid


def killed_in_own_process_group(run: Callable[[], object]) -> int:
    """Run ``run()`` in a forked child that leads its own process group (the worker's kill takes the group
    down: the child runner, torchrun and the workers, never this test); returns the child's wait status."""
    pid = fork()
    if pid == 0:
        status = 3  # it finished: the kill never came
        try:
            os.setsid()
            run()
        except BaseException:  # noqa: BLE001 (any failure must end the child, not continue the test in it)
            status = 4
        finally:
            os._exit(status)
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while time.monotonic() < deadline:
        done, wait_status = os.waitpid(pid, os.WNOHANG)
        if done:
            wait_for_group_exit(pid)
            return wait_status
        time.sleep(0.2)
    os.killpg(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail(f"the run was not killed within {CHILD_TIMEOUT_S} s")


GROUP_EXIT_S = 30.0


def wait_for_group_exit(group: int) -> None:
    """Until no live process of the killed run is left: its group, and the workers torchrun started in
    sessions of their own (they stop within seconds once they see the runner gone, and hold the run's lock
    until then). The child runner is reaped first, while they may still be exiting (a rerun then refuses
    the run directory, as it should): on a loaded machine that took longer than the test's next launch.
    Zombies count as gone: their files are closed (and a container's init may never reap them)."""
    deadline = time.monotonic() + GROUP_EXIT_S
    while time.monotonic() < deadline:
        if not live_members(group):
            return
        time.sleep(0.1)
    pytest.fail(f"processes {live_members(group)} of the killed run were left after {GROUP_EXIT_S:g} s")


def live_members(group: int) -> list[int]:
    """The pids of the processes that are not zombies (from /proc) and are in ``group`` or were started for
    the runner whose pid is ``group`` (the forked child runs the runner itself)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue  # it ended while we looked, or is not ours to read
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state, ppid, pgrp, ...
        of_runner = f"{RUNNER_PID_ENV}={group}".encode() in environ
        if (int(fields[2]) == group or of_runner) and fields[0] != "Z":
            members.append(int(entry.name))
    return members
