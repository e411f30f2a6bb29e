"""The runner killed during training (a real 2-process chain of the tiny GPT on CPU, ``cona train --chain``
in its own process): SIGKILL of the runner alone, SIGKILL of its process group (runner and torchrun; the
workers sit in sessions of their own), SIGTERM of the runner. No worker may outlive it by more than a few
seconds (before, they trained the stage to its end, appended metrics and saved), SIGTERM ends it with one
line and ``runner_state.json`` as it was, and the same command again trains what an uninterrupted run
trains: samples 0..N-1 in order, each once, with the killed attempt's losses.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from tests.helpers.observed import TRACE_ENV, assert_each_sample_once_in_order
from tests.helpers.recorded_run import running_copy
from tests.helpers.tiny_runs import chain_args, free_port_base, write_chain

from cona.commands import train_runs
from cona.engine.session import RunnerWatch
from cona.processes import process_state
from cona.runner.launch import PIDS_FILE, Topology, record_pids
from cona.runner.run_lock import lock_path
from cona.runner.schedules.chain_schedule import run_chain
from cona.runner.views.status import collect_status, find_processes, status_lines

ITERS = 40
STEPS = [{"dp": 2, "tp": 1, "pp": 1, "gbs": 8, "mbs": 4, "train_iters": ITERS, "is_initial": True}]
KILL_AFTER_ITERATION = 3
WORKERS_GONE_S = 10.0
REPO = Path(__file__).resolve().parents[2]


def metrics(run_dir: Path) -> list[dict]:
    """The complete lines of the run's metrics (a line being written may not be yet)."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return []
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def start_runner(args) -> subprocess.Popen:
    """``cona train --chain ...`` as a process of its own, leading its own process group."""
    command = [
        sys.executable, "-m", "cona.cli", "train", "--chain", args.chain, "--config", args.config,
        "--workdir", str(args.workdir), "--run-name", args.run_name, "--gpus", "2", "--device", "cpu",
        "--master-port-base", str(args.master_port_base), "--quiet",
    ]  # fmt: skip
    python_path = [str(REPO / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, **TRACE_ENV, "PYTHONPATH": os.pathsep.join(python_path)}
    return subprocess.Popen(
        command, env=env, cwd=args.workdir, start_new_session=True, stderr=subprocess.PIPE, text=True
    )


def wait_until(condition, *, timeout_s: float, what: str) -> float:
    began = time.monotonic()
    while not condition():
        if time.monotonic() - began > timeout_s:
            pytest.fail(f"waited {timeout_s} s for {what}")
        time.sleep(0.1)
    return time.monotonic() - began


def lock_is_free(run_dir: Path) -> bool:
    """Whether nobody holds the flock a runner takes on ``run_dir`` (taken and released at once)."""
    with open(lock_path(run_dir), "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(lock, fcntl.LOCK_UN)
        return True


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("how", ["sigkill-runner", "sigkill-group", "sigterm-runner"])
def test_killing_the_runner_during_training_stops_the_workers_and_the_rerun_trains_as_uninterrupted(
    tmp_path, monkeypatch, how, tiny_config_file
):
    for name, value in TRACE_ENV.items():  # the rerun's workers record what they train on too
        monkeypatch.setenv(name, value)
    config = tiny_config_file(data="markov")
    chain = write_chain(tmp_path / "chain.json", STEPS)
    args = chain_args(config, chain, tmp_path, "killed", stages=1)
    run_dir = tmp_path / "logs" / "killed"
    runner = start_runner(args)
    try:
        wait_until(
            lambda: len(metrics(run_dir)) >= KILL_AFTER_ITERATION or runner.poll() is not None,
            timeout_s=240,
            what="training to start",
        )
        assert runner.poll() is None, runner.stderr.read()
        workers = find_processes(run_dir).workers
        assert workers is not None and len(workers) == 2
        assert "2 worker(s) alive" in dict(status_lines(collect_status(run_dir)))["processes"]
        state_before = (run_dir / "runner_state.json").read_bytes()
        if how == "sigkill-group":
            os.killpg(runner.pid, signal.SIGKILL)
        else:
            runner.send_signal(signal.SIGKILL if how == "sigkill-runner" else signal.SIGTERM)
        returncode = runner.wait(timeout=60)
    finally:
        if runner.poll() is None:
            os.killpg(runner.pid, signal.SIGKILL)
            runner.wait()
    took = wait_until(
        lambda: not find_processes(run_dir).workers, timeout_s=WORKERS_GONE_S, what="the workers to stop"
    )
    # torchrun follows its workers; until it has, it holds the run's locks and a rerun would be refused
    wait_until(lambda: not find_processes(run_dir).launchers, timeout_s=30, what="torchrun to end")
    assert took < WORKERS_GONE_S
    killed = metrics(run_dir)
    assert len(killed) < ITERS  # they did not train the stage to its end
    assert not (tmp_path / "checkpoints").exists() or not list(
        (tmp_path / "checkpoints").rglob("global_step*")
    )
    assert "worker(s) alive" not in dict(status_lines(collect_status(run_dir)))["processes"]
    if how == "sigterm-runner":
        assert returncode == 128 + signal.SIGTERM
        stderr = runner.stderr.read()
        assert "cona: stopped by SIGTERM: the workers were stopped; the same command resumes" in stderr
        assert (run_dir / "runner_state.json").read_bytes() == state_before

    # What the refusal tells a user to do: wait until the last process holding the run's lock has ended
    # (on a loaded machine that can take a while after the workers left the process table's view above).
    wait_until(lambda: lock_is_free(run_dir), timeout_s=60, what="the run directory's lock to be free")
    args.master_port_base = free_port_base(1)  # the killed stage's port may still be held
    state = run_chain(train_runs.chain_run(args), out=lambda line: None)
    assert state.stages[-1].status == "done"
    records = metrics(run_dir)
    rerun = {record["iteration"]: record["loss"] for record in records[len(killed) :]}
    assert sorted(rerun) == list(range(1, ITERS + 1))
    np.testing.assert_allclose(
        [rerun[record["iteration"]] for record in killed], [record["loss"] for record in killed], rtol=1e-6
    )
    assert_each_sample_once_in_order(run_dir, total_samples=ITERS * 8)


def test_the_runner_watch_sees_a_dead_or_unreaped_runner_and_checks_at_most_once_an_interval():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert RunnerWatch(dead.pid, interval_s=0.0).runner_gone()
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    wait_until(lambda: (process_state(zombie.pid) or ("Z",))[0] == "Z", timeout_s=10, what="its exit")
    try:
        assert RunnerWatch(zombie.pid, interval_s=0.0).runner_gone()
    finally:
        zombie.wait()
    assert not RunnerWatch(os.getpid(), interval_s=0.0).runner_gone()
    assert not RunnerWatch(dead.pid, interval_s=60.0).runner_gone()  # not due yet: no check, no cost


def test_status_names_workers_that_outlive_their_runner_and_torchrun(tmp_path):
    run_dir = running_copy(tmp_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    path = record_pids(
        run_dir / "stages" / "3" / PIDS_FILE, Topology(nproc_per_node=2, master_port=29503), dead.pid
    )
    record = json.loads(path.read_text())
    path.write_text(json.dumps({**record, "runner_pid": dead.pid}))
    spec = run_dir / "stages" / "3" / "spec.json"
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(spec)])
    deadline = time.monotonic() + 10
    while str(spec) not in Path(f"/proc/{orphan.pid}/cmdline").read_bytes().decode(errors="replace"):
        assert time.monotonic() < deadline, "the stand-in worker never ran"
        time.sleep(0.01)  # until the child has exec'd: before, its command line is pytest's
    try:
        text = dict(status_lines(collect_status(run_dir)))["processes"]
    finally:
        orphan.kill()
        orphan.wait()
    assert text.endswith(f"; 1 worker(s) alive (pids {orphan.pid})"), text
    assert f"runner pid {dead.pid} gone" in text
