"""Whether a process exists on this host, as `cona status`, a waiting session worker and a run's lock
ask it (with its start time from /proc, which tells a reused pid apart)."""

from __future__ import annotations

import os
from pathlib import Path

PROC = Path("/proc")
START_TOLERANCE_S = 1.0
"""Slack between a process's start time in /proc (boot time is in whole seconds) and its recorded time."""


def signal_reaches(pid: int) -> bool:
    """Whether signal 0 reaches ``pid``: the process exists (maybe as a zombie, maybe another user's)."""
    if pid <= 0:
        return False  # signal 0 to pid 0 or -1 would test a whole process group
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, under another user
    return True


def running(pid: int, proc_root: Path = PROC) -> bool:
    """Whether ``pid`` exists and is no zombie (a killed process its parent has not reaped yet)."""
    if not signal_reaches(pid):
        return False
    state = process_state(pid, proc_root)
    return state is None or state[0] != "Z"


def pid_alive(pid: int, recorded_at: float, proc_root: Path = PROC) -> bool:
    """Whether the process recorded at ``recorded_at`` with this pid still runs on this host: signal 0
    reaches it and, where /proc tells, it is no zombie and started no later than it was recorded (a later
    start is another process that got the pid after ours ended)."""
    if not signal_reaches(pid):
        return False
    started = process_state(pid, proc_root)
    if started is None:
        return True
    state, start_time = started
    return state != "Z" and start_time <= recorded_at + START_TOLERANCE_S


def process_state(pid: int, proc_root: Path = PROC) -> tuple[str, float] | None:
    """(state letter, unix start time) of a process from ``/proc``; None where /proc cannot tell."""
    try:
        stat = (proc_root / str(pid) / "stat").read_text()
        boot_line = next(
            line for line in (proc_root / "stat").read_text().splitlines() if line.startswith("btime ")
        )
    except (OSError, StopIteration):
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # the command name in parentheses may hold spaces
    ticks_per_s = os.sysconf("SC_CLK_TCK")
    return fields[0], int(boot_line.split()[1]) + int(fields[19]) / ticks_per_s
