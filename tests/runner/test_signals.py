"""The runner's signals (:mod:`cona.runner.signals`): SIGTERM, SIGINT and SIGHUP each stop it with one
line and exit 128 + signal, leaving the run resumable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHILD = (
    "import os, signal, sys\n"
    "from cona.runner.signals import RunStopped, stop_on_signals\n"
    "try:\n"
    "    with stop_on_signals():\n"
    "        os.kill(os.getpid(), getattr(signal, sys.argv[1]))\n"
    "        signal.pause()\n"
    "except RunStopped as err:\n"
    "    print(err)\n"
    "    sys.exit(err.exit_code)\n"
)


@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT", "SIGHUP"])
def test_each_stopping_signal_raises_run_stopped_with_128_plus_its_number(name):
    """SIGHUP (the terminal or SSH session went away) killed the runner outright with no word; it now stops
    the run as SIGTERM does. A child process takes the signal, so the test process never does."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, name], env=env, capture_output=True, text=True, timeout=60
    )
    number = getattr(signal, name)
    assert done.returncode == 128 + number, done
    assert done.stdout.startswith(f"stopped by {name}: the workers were stopped; the same command resumes")
