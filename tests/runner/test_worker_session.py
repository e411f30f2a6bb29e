"""Stages of a chain in the same worker processes (:class:`cona.runner.worker_session.WorkerSession`):
real 2-process chains of the tiny GPT against the per-stage launch, a stage failing inside a session, and
workers whose runner is gone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from tests.helpers.forked import fork
from tests.helpers.observed import TRACE_ENV, assert_each_sample_once_in_order, assert_lr_follows_schedule
from tests.helpers.recorded_run import running_copy
from tests.helpers.tiny_runs import chain_args, free_port_base, write_chain

from cona.cli import main
from cona.commands import train_runs
from cona.engine.session import wait_for_command
from cona.errors import LaunchError
from cona.runner.launch import PIDS_FILE, Topology, record_exit, record_pids, torchrun_command
from cona.runner.publish import publish
from cona.runner.schedules.chain_schedule import run_chain
from cona.runner.state import load_state
from cona.runner.views.status import collect_status, status_lines
from cona.runner.worker_session import WorkerSession

STEPS = [
    {"dp": 2, "tp": 1, "pp": 1, "gbs": 8, "mbs": 4, "train_iters": 2, "is_initial": True, "convert": True},
    {"dp": 1, "tp": 2, "pp": 1, "gbs": 16, "mbs": 4, "extra_iters": 2, "convert": True},
    {"dp": 1, "tp": 1, "pp": 2, "gbs": 16, "mbs": 4, "extra_iters": 1},
]
TOTAL_SAMPLES = 2 * 8 + 2 * 16 + 1 * 16


def torchrun_pids(run_dir: Path) -> list[int]:
    """The torchrun pid each stage's pids.json names, in stage order."""
    stages = sorted((run_dir / "stages").iterdir(), key=lambda path: int(path.name))
    return [json.loads((stage / "pids.json").read_text())["torchrun_pid"] for stage in stages]


def losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def gone(pid: int) -> bool:
    """No such process, or only its zombie (an orphan's exit status waits for whoever adopted it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_session_chain_trains_as_the_per_stage_launch_does_without_restarting_the_workers(
    tmp_path, monkeypatch, tiny_config_file
):
    for name, value in TRACE_ENV.items():  # the workers record what they train on
        monkeypatch.setenv(name, value)
    config = tiny_config_file(data="markov", training={"lr_scale_strategy": "linear"})
    raw = json.loads(config.read_text())
    chain = write_chain(tmp_path / "chain.json", STEPS)
    with WorkerSession() as session:
        reused = run_chain(
            train_runs.chain_run(chain_args(config, chain, tmp_path / "reused", "reused", stages=len(STEPS))),
            launcher=session,
            out=lambda line: None,
        )
    restarted = run_chain(
        train_runs.chain_run(
            chain_args(config, chain, tmp_path / "restarted", "restarted", stages=len(STEPS))
        ),
        out=lambda line: None,
    )

    logs = tmp_path / "logs"
    assert reused.stages[-1].consumed_samples == restarted.stages[-1].consumed_samples == TOTAL_SAMPLES
    assert [stage.status for stage in reused.stages] == ["done"] * len(STEPS)
    np.testing.assert_allclose(losses(logs / "reused"), losses(logs / "restarted"), rtol=1e-6, atol=0)
    assert len(losses(logs / "reused")) == 5
    # What the workers trained on and the LR they applied, in both: the linear rule's schedule.
    for name in ("reused", "restarted"):
        trained = assert_each_sample_once_in_order(logs / name, total_samples=TOTAL_SAMPLES)
        decay_tokens = TOTAL_SAMPLES * raw["model"]["seq"]
        assert_lr_follows_schedule(trained, raw, rule="linear", decay_tokens=decay_tokens)
    # One torchrun for the whole chain, gone at the end; a new one per stage without the session.
    session_pids = torchrun_pids(logs / "reused")
    assert len(set(session_pids)) == 1 and gone(session_pids[0])
    assert len(set(torchrun_pids(logs / "restarted"))) == len(STEPS)
    assert all(record["returncode"] == 0 for record in _pids_records(logs / "reused"))
    assert not list((logs / "reused").glob("session-*"))  # the session's command files are cleaned up
    # The switches still went through the checkpoint (verified after loading), without a process start.
    for reused_stage, restarted_stage in zip(reused.stages[1:], restarted.stages[1:], strict=True):
        assert reused_stage.switch_check["status"] == "passed"
        reused_start = reused_stage.switch_cost["process_start_s"]
        restarted_start = restarted_stage.switch_cost["process_start_s"]
        assert reused_start < 0.2 * restarted_start, (reused_start, restarted_start)


def _pids_records(run_dir: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted(run_dir.glob("stages/*/pids.json"))]


@pytest.mark.multiproc
def test_a_stage_failing_in_a_session_names_the_stage_and_rank_and_leaves_no_process(
    tmp_path, tiny_config_file
):
    config = tiny_config_file(data="markov")
    chain = write_chain(tmp_path / "chain.json", STEPS[:2])

    def publish_without_shards(checkpoint: Path) -> Path:
        """Publishes, then loses the tensors: stage 2 fails loading them (in the processes of stage 1)."""
        universal = publish(checkpoint)
        for shard in universal.glob("*.distcp"):
            shard.unlink()
        return universal

    args = chain_args(config, chain, tmp_path, "failing", stages=2)
    failing = pytest.raises(LaunchError, match=r"^stage 2: rank \d failed: ")
    with failing as failure, WorkerSession() as session:
        run_chain(
            train_runs.chain_run(args),
            launcher=session,
            out=lambda line: None,
            publisher=publish_without_shards,
        )
    run_dir = tmp_path / "logs" / "failing"
    assert str(run_dir / "stages" / "2" / "rank") in str(failure.value)  # the traceback file it names
    first, second = torchrun_pids(run_dir)
    assert first == second and gone(first)
    records = _pids_records(run_dir)
    assert records[0]["returncode"] == 0 and records[1]["returncode"] != 0
    assert [stage.status for stage in load_state(run_dir).stages] == ["done", "running"]


@pytest.mark.slow
@pytest.mark.multiproc
def test_sigkill_of_the_runner_between_stages_leaves_no_worker_and_the_rerun_finishes(
    tmp_path, tiny_config_file
):
    """Only the runner is killed, while the session's workers wait for stage 2 (the runner hangs in its
    publish): they notice, leave, and torchrun ends; the same command again finishes the chain."""
    config = tiny_config_file(data="markov")
    chain = write_chain(tmp_path / "chain.json", STEPS[:2])
    args = chain_args(config, chain, tmp_path, "killed", stages=2)
    publishing = tmp_path / "publishing"

    def publish_and_hang(checkpoint: Path) -> Path:
        publishing.write_text(str(checkpoint))
        time.sleep(600)  # killed here
        return publish(checkpoint)

    runner = fork()
    if runner == 0:
        try:
            with WorkerSession() as session:
                run_chain(
                    train_runs.chain_run(args),
                    launcher=session,
                    out=lambda line: None,
                    publisher=publish_and_hang,
                )
        finally:
            os._exit(3)
    try:
        _wait_until(publishing.exists, timeout_s=240, what="stage 1 to end")
        (torchrun,) = torchrun_pids(tmp_path / "logs" / "killed")
        assert not gone(torchrun)  # the session's processes wait for the next stage
    finally:
        os.kill(runner, signal.SIGKILL)
        os.waitpid(runner, 0)
    _wait_until(lambda: gone(torchrun), timeout_s=30, what="the orphaned session to end")

    args.master_port_base = free_port_base(2)
    with WorkerSession() as session:
        state = run_chain(train_runs.chain_run(args), launcher=session, out=lambda line: None)
    assert [stage.status for stage in state.stages] == ["done", "done"]
    assert state.stages[-1].consumed_samples == 2 * 8 + 2 * 16


def _wait_until(condition, *, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"waited {timeout_s} s for {what}")
        time.sleep(0.1)


def test_waiting_workers_stop_waiting_when_the_runner_is_gone(tmp_path):
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    began = time.monotonic()
    assert wait_for_command(tmp_path / "next-2.json", runner_pid=ended.pid, poll_s=0.01) is None
    assert time.monotonic() - began < 1.0


def test_waiting_workers_read_the_runners_command(tmp_path):
    command = {"spec": "stages/2/spec.json", "written_at": 1.5}
    (tmp_path / "next-2.json").write_text(json.dumps(command))
    assert wait_for_command(tmp_path / "next-2.json", runner_pid=os.getpid()) == command


def test_the_session_flag_follows_the_spec_on_torchruns_command_line(tmp_path):
    command = torchrun_command(
        tmp_path / "spec.json", Topology(nproc_per_node=2, master_port=29501), worker_args=("--session", "S")
    )
    assert command[-5:] == ["-m", "cona.engine.worker", str(tmp_path / "spec.json"), "--session", "S"]


def test_status_tells_a_finished_session_stage_from_its_still_running_torchrun(tmp_path):
    run_dir = running_copy(tmp_path)
    topology = Topology(nproc_per_node=4, master_port=29503)
    torchrun = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        path = record_pids(run_dir / "stages" / "3" / PIDS_FILE, topology, torchrun.pid, session="session-1")
        record_exit(path, 0)
        waiting = dict(status_lines(collect_status(run_dir)))["processes"]
    finally:
        torchrun.kill()
        torchrun.wait()
    stopped = dict(status_lines(collect_status(run_dir)))["processes"]

    me = os.getpid()
    stage_end = f"stage 3: runner pid {me} alive, stage ended with code 0, torchrun pid {torchrun.pid}"
    assert waiting == f"{stage_end} alive, kept for the next stage"
    assert stopped == f"{stage_end} gone"


def test_restart_workers_is_refused_where_there_is_one_stage_only(tmp_path, capsys):
    fixed = ["--dp", "1", "--tp", "1", "--pp", "1", "--gbs", "1", "--mbs", "1", "--iters", "1"]
    assert main(["train", *fixed, "--workdir", str(tmp_path), "--restart-workers"]) == 2
    assert "--restart-workers goes with --chain or online mode" in capsys.readouterr().err
