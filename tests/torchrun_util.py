"""Launch a script or module under torchrun (gloo, CPU) from a test, with a free port and a timeout."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_torchrun(
    args: list[str], nproc: int, *, timeout: float = 300, env: dict | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """Run ``torchrun --nproc-per-node nproc <args>`` and return the finished process (output captured)."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        *args,
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd or ROOT
    )
