"""One run at a time on a run directory and on a checkpoint folder (:mod:`cona.runner.run_lock`): a second
run is refused with one line naming the holder, before it reads or writes anything; a killed holder's lock
blocks nothing."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.helpers.forked import fork
from tests.helpers.tiny_runs import chain_args, write_chain

from cona.cli import main
from cona.commands import train_runs
from cona.config.file import load_config
from cona.engine.checkpoint.paths import layout_dir
from cona.processes import running
from cona.runner.launch import start_torchrun
from cona.runner.run_lock import RunLocked, lock_directory, lock_path, popen_holding_locks, run_locks
from cona.runner.schedules.chain_schedule import run_chain
from cona.strategy import Strategy

REPO = Path(__file__).resolve().parents[2]
HOLD = (
    "import sys, time\n"
    "from cona.runner.run_lock import lock_directory, run_locks\n"
    "with run_locks():\n"
    "    for directory in sys.argv[1:]:\n"
    "        lock_directory(directory, 'directory')\n"
    "    print('held', flush=True)\n"
    "    time.sleep(120)\n"
)
STEPS = [{"dp": 2, "tp": 1, "pp": 1, "gbs": 8, "mbs": 4, "train_iters": 2, "is_initial": True}]


def hold(*directories: Path) -> subprocess.Popen:
    """Another process holding the locks of ``directories`` until killed."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, *map(str, directories)], env=env, stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout.readline() == "held\n"
    return holder


def kill(holder: subprocess.Popen) -> None:
    holder.send_signal(signal.SIGKILL)
    holder.wait()


def test_a_held_directory_is_refused_naming_the_holder_and_free_once_the_holder_is_killed(tmp_path):
    directory = tmp_path / "logs" / "run"
    holder = hold(directory)
    try:
        with pytest.raises(RunLocked) as refused, run_locks():
            lock_directory(directory, "run directory")
        host = socket.gethostname()
        assert str(refused.value).startswith(
            f"run directory {directory} is in use by pid {holder.pid} on host {host}"
        )
        assert "\n" not in str(refused.value)
    finally:
        kill(holder)
    with run_locks():  # the killed holder's lock file is still there; its lock is not
        assert lock_path(directory).is_file()
        lock_directory(directory, "run directory")
        lock_directory(directory, "run directory")  # held by this process already: nothing to do
    with run_locks():  # released when the scope ended
        lock_directory(directory, "run directory")


def test_a_scope_s_end_releases_its_locks_while_a_launcher_it_started_still_runs(tmp_path):
    """A worker session's torchrun shares the lock's open file (it inherits the descriptor) and may outlive
    the scope: closing the runner's descriptor alone would leave the lock held for as long as it lives."""
    directory = tmp_path / "logs" / "run"
    with run_locks():
        lock_directory(directory, "run directory")
        launcher = popen_holding_locks(["sleep", "60"])
    try:
        with run_locks():
            lock_directory(directory, "run directory")
    finally:
        kill(launcher)


def test_a_second_chain_on_a_live_run_directory_or_checkpoint_folder_is_refused_before_it_starts(
    tmp_path, tiny_config_file
):
    config = tiny_config_file(data="markov")
    chain = write_chain(tmp_path / "chain.json", STEPS)
    args = chain_args(config, chain, tmp_path, "first", stages=1)
    run_dir = tmp_path / "logs" / "first"
    holder = hold(run_dir)
    try:
        with pytest.raises(RunLocked, match=rf"^run directory {run_dir} is in use by pid {holder.pid} "):
            run_chain(train_runs.chain_run(args), out=lambda line: None)
    finally:
        kill(holder)
    assert not run_dir.exists()  # refused before it wrote anything

    strategy = Strategy(dp=2, tp=1, pp=1, gbs=8, mbs=4)
    layout = layout_dir(tmp_path, load_config(config), strategy, "fp32", run_name="second")
    holder = hold(layout)
    try:  # held by a run of the same name under another log_root: its checkpoints go into the same folder
        args.run_name = "second"
        with pytest.raises(RunLocked, match=rf"^checkpoint folder {layout} is in use by pid {holder.pid} "):
            run_chain(train_runs.chain_run(args), out=lambda line: None)
    finally:
        kill(holder)


def test_a_fixed_run_into_a_live_checkpoint_folder_is_refused(tmp_path, capsys, tiny_config_file):
    config = tiny_config_file(data="markov")
    strategy = Strategy(dp=1, tp=1, pp=1, gbs=8, mbs=4)
    layout = layout_dir(tmp_path, load_config(config), strategy, "fp32", run_name="fixed")
    fixed = ["--dp", "1", "--tp", "1", "--pp", "1", "--gbs", "8", "--mbs", "4", "--iters", "1"]
    fixed += ["--run-name", "fixed"]
    holder = hold(layout)
    try:
        code = main(["train", *fixed, "--config", str(config), "--workdir", str(tmp_path), "--device", "cpu"])
    finally:
        kill(holder)
    assert code == 1
    assert f"cona: error: checkpoint folder {layout} is in use by pid {holder.pid}" in capsys.readouterr().err


def test_torchrun_keeps_a_killed_runners_locks_until_it_ends(tmp_path):
    """The runner dies at once (as under SIGKILL); the process it started as torchrun still holds its run
    directory, so a rerun is refused until that process, which outlives its workers, has ended."""
    directory = tmp_path / "logs" / "run"
    pid_file = tmp_path / "torchrun.pid"
    runner = fork()
    if runner == 0:
        try:
            with run_locks():
                lock_directory(directory, "run directory")
                with open(tmp_path / "torchrun.log", "w") as log:
                    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
                    torchrun = start_torchrun(sleeper, os.environ, log, quiet=True)
                pid_file.write_text(str(torchrun.pid))
                os._exit(0)  # no scope exit: the kernel closes the runner's descriptors, as SIGKILL would
        finally:
            os._exit(1)
    os.waitpid(runner, 0)
    torchrun = int(pid_file.read_text())
    try:
        refused = rf"in use by the workers of pid {runner} on host .*, which is gone"
        with pytest.raises(RunLocked, match=refused), run_locks():
            lock_directory(directory, "run directory")
    finally:
        os.kill(torchrun, signal.SIGKILL)
    wait_gone(torchrun)
    with run_locks():
        lock_directory(directory, "run directory")


def wait_gone(pid: int) -> None:
    deadline = time.monotonic() + 10
    while running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_lock_path_planted_as_a_link_or_a_foreign_file_is_refused_and_left_as_it_is(tmp_path):
    """Whoever can create a file beside a shared run directory must not make the next run overwrite a file
    of its user: a symbolic link, a hard link, a FIFO, a directory or a file holding other data at the lock's
    path is refused by name, and the file behind it keeps its bytes."""
    directory = tmp_path / "logs" / "run"
    directory.parent.mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    path = lock_path(directory)
    plants = {
        "it is a symbolic link": lambda: path.symlink_to(victim),
        "is a symbolic link": lambda: path.symlink_to(tmp_path / "nowhere"),
        "has other links": lambda: os.link(victim, path),
        "not a regular file": lambda: os.mkfifo(path),
        "Is a directory": lambda: path.mkdir(),
        "not made by CONA": lambda: path.write_text("precious\n"),
    }
    for reason, plant in plants.items():
        plant()
        with (
            pytest.raises(RunLocked, match=f"^cannot lock run directory {directory}: .*{reason}"),
            run_locks(),
        ):
            lock_directory(directory, "run directory")
        assert victim.read_text() == "precious\n"
        assert not (tmp_path / "nowhere").exists()
        if path.is_symlink() or not path.is_dir():
            path.unlink()
        else:
            path.rmdir()
    with run_locks():  # an empty lock file, or one a killed run left, is CONA's: taken
        path.touch()
        lock_directory(directory, "run directory")
    with run_locks():
        lock_directory(directory, "run directory")
        assert json.loads(path.read_text())["pid"] == os.getpid()
