"""Two runs at once on one host with the default ports: without ``--master-port-base`` every
stage's torchrun picks a free port (``--standalone``), so neither run waits for or steals the other's
rendezvous. The ports the old fixed default gave (29400 + stage) are held by this test meanwhile, as another
user's run would hold them: a run that still used them would be refused ("master port ... is in use")."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

import pytest
from tests.helpers.tiny import write_tiny_config
from tests.helpers.tiny_runs import write_chain

from cona.runner.launch import DEFAULT_MASTER_PORT_BASE

TIMEOUT_S = 480
STEPS = [  # 2 processes; the switch runs in the same worker session, which keeps its first stage's port
    {"dp": 2, "tp": 1, "pp": 1, "gbs": 8, "mbs": 2, "train_iters": 2, "is_initial": True},
    {"dp": 1, "tp": 2, "pp": 1, "gbs": 8, "mbs": 4, "train_iters": 4},
]

FIXED_ARGS = ["--dp", "2", "--tp", "1", "--pp", "1", "--gbs", "8", "--mbs", "2", "--iters", "4"]


def _hold(stack: ExitStack, port: int) -> None:
    """Listen on ``port`` for the test's duration (if someone else already does, it is held anyway)."""
    sock = stack.enter_context(socket.socket())
    try:
        sock.bind(("", port))
    except OSError:
        return
    sock.listen()


def _start(directory: Path, mode_args: list[str]) -> subprocess.Popen:
    config = write_tiny_config(directory, data="markov")
    command = [
        sys.executable, "-m", "cona", "train", *mode_args,
        "--config", str(config), "--workdir", str(directory), "--run-name", "run",
        "--device", "cpu", "--quiet",
    ]  # fmt: skip
    return subprocess.Popen(
        command, cwd=directory, env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.multiproc
def test_two_runs_at_once_with_default_ports_both_finish(tmp_path):
    chain_dir, fixed_dir = tmp_path / "chain", tmp_path / "fixed"
    chain_dir.mkdir()
    fixed_dir.mkdir()
    chain = write_chain(chain_dir / "chain.json", STEPS)
    with ExitStack() as held:
        for stage in (1, 2):
            _hold(held, DEFAULT_MASTER_PORT_BASE + stage)
        runs = {
            "chain": _start(chain_dir, ["--chain", str(chain), "--gpus", "2"]),
            "fixed": _start(fixed_dir, FIXED_ARGS),
        }
        outputs = {name: process.communicate(timeout=TIMEOUT_S)[0] for name, process in runs.items()}
    for name, process in runs.items():
        assert process.returncode == 0, f"the {name} run failed:\n{outputs[name]}"
    for directory in (chain_dir, fixed_dir):
        command = (directory / "logs" / "run" / "stages" / "1" / "torchrun.log").read_text().splitlines()[0]
        assert "--standalone" in command.split() and "--master-port" not in command
    # the chain's second stage ran in the first stage's workers (no torchrun of its own)
    assert not (chain_dir / "logs" / "run" / "stages" / "2" / "torchrun.log").exists()
    assert "stage 2" in outputs["chain"]
