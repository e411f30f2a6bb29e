"""Launch a script or module under torchrun (gloo, CPU) from a test, with a free port and a timeout."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
from pathlib import Path

from tests.helpers.paths import ROOT

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PORT = 20000
ROOM = 1000
"""Ports a range outside the ephemeral one needs to be drawn from; with less, the whole unprivileged range."""


def free_port_block(size: int = 1) -> int:
    """The first of ``size`` consecutive ports that are all free now, drawn at random outside the kernel's
    ephemeral range where it leaves room. A port from that range (what binding port 0 gives) is the
    kernel's to hand to any outgoing connection, gloo's between the workers of another stage say, before
    the test's run binds it: a multi-node test failed once in ~20 runs, and a port taken that way would make
    it so."""
    try:
        low, high = (int(value) for value in EPHEMERAL_RANGE.read_text().split()[:2])
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    ranges = [(LOWEST_PORT, low - size), (high + 1, 65536 - size)]
    start, stop = next(((a, b) for a, b in ranges if b - a >= ROOM), (1024, 65536 - size))
    draw = random.SystemRandom()
    for _ in range(1000):
        first = draw.randrange(start, stop)
        if all(_bindable(port) for port in range(first, first + size)):
            return first
    raise RuntimeError(f"no {size} consecutive free ports from {start} to {stop + size - 1}")


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    return free_port_block(1)


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
