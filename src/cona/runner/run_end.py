"""How a runner's last invocation of a run ended, as ``cona status`` tells it once no process of the run runs.

The stage driver writes ``<run_dir>/runner_end.json`` when it leaves the run, however it leaves it: finished
(the run is done, or there was nothing left to do), stopped (SIGTERM or Ctrl-C: the same command resumes it)
or failed (a stage's workers or the runner itself raised: the first line of the error). A runner killed
outright (SIGKILL, the machine lost) writes nothing: a run whose processes are gone and whose newest runner
left no end of its own was killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from cona import run_files
from cona.atomic_files import write_json_atomic

How = Literal["finished", "stopped", "failed"]
MESSAGE_CHARS = 300
"""The recorded error is its first line, cut to this many characters."""


@dataclass(frozen=True, kw_only=True)
class RunnerEnd:
    how: How
    message: str
    """Why: the signal that stopped it, or the error's first line (empty when finished)."""
    pid: int
    host: str
    ended: float
    """Unix time."""
    exit_code: int


def end_of(error: BaseException | None) -> tuple[How, str, int]:
    """How a runner leaving with ``error`` (None: normally) ended, with its message and exit status."""
    if error is None:
        return "finished", "", 0
    exit_code = getattr(error, "exit_code", None)
    if isinstance(error, KeyboardInterrupt):
        text = str(error) or "interrupted"
        return "stopped", text.split(":")[0], exit_code if isinstance(exit_code, int) else 130
    lines = str(error).strip().splitlines()
    first = lines[0] if lines else type(error).__name__
    return "failed", first[:MESSAGE_CHARS], 1


def record_runner_end(run_dir: Path, error: BaseException | None) -> None:
    """Write how this runner leaves the run (never raises: the run's own error must reach the user)."""
    how, message, exit_code = end_of(error)
    end = RunnerEnd(
        how=how,
        message=message,
        pid=os.getpid(),
        host=socket.gethostname(),
        ended=time.time(),
        exit_code=exit_code,
    )
    # a full disk or a removed run directory: status then reads the run as killed
    with contextlib.suppress(OSError):
        write_json_atomic(run_files.runner_end_path(run_dir), asdict(end))


def read_runner_end(run_dir: Path) -> RunnerEnd | None:
    """The recorded end, None when there is none (or it is unreadable)."""
    try:
        return RunnerEnd(**json.loads(run_files.runner_end_path(run_dir).read_text()))
    except (OSError, ValueError, TypeError):
        return None
