"""Running a whole run in a forked child that a test's worker kills, for the SIGKILL end-to-end tests."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import pytest

CHILD_TIMEOUT_S = 480


def killed_in_own_process_group(run: Callable[[], object]) -> int:
    """Run ``run()`` in a forked child that leads its own process group (the worker's kill takes the group
    down: the child runner, torchrun and the workers, never this test); returns the child's wait status."""
    pid = os.fork()
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
            return wait_status
        time.sleep(0.2)
    os.killpg(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail(f"the run was not killed within {CHILD_TIMEOUT_S} s")
