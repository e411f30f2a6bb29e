"""``cona status`` on the recorded run directory, finished and made to look mid-run."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from tests.helpers.paths import RUN_CHAIN_SMALL
from tests.helpers.recorded_run import running_copy

from cona.cli import main
from cona.errors import LaunchError
from cona.runner.launch import PIDS_FILE, Topology, record_exit, record_pids
from cona.runner.run_dir import point_latest
from cona.runner.run_end import record_runner_end
from cona.runner.signals import RunStopped
from cona.runner.state import load_state, save_state
from cona.runner.views.status import (
    collect_status,
    find_processes,
    pid_alive,
    process_state,
    render_status,
    status_lines,
)

FIXTURE = RUN_CHAIN_SMALL
LAST_METRICS_TIME = 1795945186.711  # the fixture's last metrics line


def rendered(status) -> str:
    console = Console(file=io.StringIO(), width=160, color_system=None)
    render_status(status, console)
    return console.file.getvalue()


def test_status_of_a_finished_run():
    status = collect_status(FIXTURE, now=LAST_METRICS_TIME + 30)
    lines = dict(status_lines(status))

    assert lines["stage"] == "3 of 3 (finished)"
    assert lines["strategy"] == "dp2 tp2 pp1 mbs8 gbs32"
    assert lines["iteration"] == "180 (last metrics 30 s ago)"  # an online stage stops at a token budget
    assert lines["tokens"] == "460,800 of 460,800 (100%), 3,600 samples"
    assert lines["eval"] == "perplexity 373.15 (loss 5.9220) at iteration 180"
    own = "work/checkpoints/run_chain_small/gpt-tiny/z1/fp32"  # the run's own folder in the workdir
    assert lines["checkpoint"].startswith(f"{own}/tp2_pp1_dp2_sp1/global_step180")
    assert "missing on disk" in lines["checkpoint"]  # the fixture carries no checkpoints
    assert lines["decision"] == "stay at iteration 180: gbs 32 is the largest allowed (max gbs)"
    assert lines["processes"] == "none (the run finished)"
    text = rendered(status)
    for label in ("stage", "iteration", "checkpoint", "markers", "decision", "processes"):
        assert f" {label}  " in text


def test_status_of_a_running_run_with_live_workers(tmp_path, monkeypatch):
    run_dir = Path(shutil.copytree(FIXTURE, tmp_path / "run_chain_small")).resolve()
    state = load_state(run_dir)
    save_state(
        run_dir, state.with_stage(dataclasses.replace(state.stage(3), status="running", checkpoint=None))
    )
    (run_dir / "stages" / "3" / "stage_result.json").unlink()
    monkeypatch.chdir(tmp_path)  # the fixture's checkpoint paths are relative
    layout = tmp_path / "work/checkpoints/run_chain_small/gpt-tiny/z1/fp32/tp1_pp1_dp4_sp1"
    (layout / "global_step110").mkdir(parents=True)
    (layout / "latest").write_text("global_step110\n")
    spec = run_dir / "stages" / "3" / "spec.json"
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(spec)])
    try:
        deadline = time.monotonic() + 10
        while not find_processes(run_dir).workers and time.monotonic() < deadline:
            time.sleep(0.05)  # until the child's command line is visible
        lines = dict(status_lines(collect_status(run_dir, now=LAST_METRICS_TIME + 600)))
    finally:
        worker.kill()
        worker.wait()

    assert lines["stage"] == "3 of 3 (running)"
    assert lines["iteration"] == "180 (last metrics 10.0 min ago)"
    assert lines["checkpoint"] == f"{layout.relative_to(tmp_path)}/global_step110"
    assert lines["markers"] == "latest -> global_step110, latest_universal missing"
    assert lines["processes"] == f"1 worker(s) alive on this host (pids {worker.pid}), torchrun none"
    after = dict(status_lines(collect_status(run_dir)))
    assert after["processes"].startswith("no worker of this run alive on this host")


def test_status_of_a_running_online_run_counts_its_switches_not_a_total(tmp_path):
    run_dir = Path(shutil.copytree(FIXTURE, tmp_path / "online")).resolve()
    state = load_state(run_dir)
    running = state.with_stage(dataclasses.replace(state.stage(3), status="running", checkpoint=None))
    save_state(run_dir, dataclasses.replace(running, chain_path="online"))

    lines = dict(status_lines(collect_status(run_dir)))

    assert lines["stage"] == "3 (running, online: 2 switches so far)"  # not "3 of 3": the search adds more
    finished = dataclasses.replace(state, chain_path="online")
    save_state(run_dir, finished)
    assert dict(status_lines(collect_status(run_dir)))["stage"] == "3 of 3 (finished)"


def test_status_of_a_run_without_state_or_metrics(tmp_path):
    run_dir = tmp_path / "fresh"
    (run_dir / "stages" / "1").mkdir(parents=True)
    shutil.copy(FIXTURE / "stages" / "1" / "spec.json", run_dir / "stages" / "1" / "spec.json")

    status = collect_status(run_dir)
    lines = dict(status_lines(status))

    assert lines["stage"] == "1 (running)"
    assert lines["strategy"] == "dp2 tp1 pp2 mbs2 gbs8"
    assert lines["iteration"] == "no metrics yet"
    assert lines["checkpoint"] == "none recorded yet"
    assert any("no metrics yet" in warning for warning in status.run.warnings)


def test_cli_status_finds_the_latest_run_from_the_config(tmp_path, monkeypatch, capsys, tiny_config_file):
    tiny_config_file()  # its log_root, logs, holds the run
    run_dir = Path(shutil.copytree(FIXTURE, tmp_path / "logs" / "run_chain_small"))
    point_latest(run_dir)
    monkeypatch.chdir(tmp_path)

    assert main(["status"]) == 0
    out = capsys.readouterr().out
    assert "run run_chain_small" in out and "3 of 3 (finished)" in out

    assert main(["status", str(tmp_path / "nowhere")]) == 1
    assert f"run directory {tmp_path / 'nowhere'} does not exist" in capsys.readouterr().err


def test_status_reads_liveness_from_the_recorded_pids(tmp_path):
    run_dir = running_copy(tmp_path)
    topology = Topology(nproc_per_node=4, master_port=29503)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        path = record_pids(run_dir / "stages" / "3" / PIDS_FILE, topology, child.pid)
        alive = dict(status_lines(collect_status(run_dir)))["processes"]
    finally:
        child.kill()
        child.wait()
    gone = dict(status_lines(collect_status(run_dir)))["processes"]
    record_exit(path, returncode=-9)
    exited = dict(status_lines(collect_status(run_dir)))["processes"]

    me = os.getpid()
    assert alive == f"stage 3: runner pid {me} alive, torchrun pid {child.pid} alive"
    assert gone == f"stage 3: runner pid {me} alive, torchrun pid {child.pid} gone, its exit not recorded"
    assert exited == f"stage 3: runner pid {me} alive, torchrun pid {child.pid} exited with code -9"


def test_a_recorded_pid_now_held_by_a_later_process_is_not_alive(tmp_path):
    me = os.getpid()
    assert pid_alive(me, recorded_at=time.time())
    if process_state(me) is not None:  # Linux: the start time tells a reused pid apart
        assert not pid_alive(me, recorded_at=process_state(me)[1] - 60.0)
    assert not pid_alive(0, recorded_at=time.time())


def test_pids_recorded_on_another_host_are_not_checked_from_here(tmp_path):
    run_dir = running_copy(tmp_path)
    record = {"host": "node-b.invalid", "node_rank": 1, "runner_pid": 12, "torchrun_pid": 34, "started": 1.0}
    (run_dir / "stages" / "3" / "pids.node1.json").write_text(json.dumps(record))
    lines = dict(status_lines(collect_status(run_dir)))
    assert lines["processes"] == (
        f"stage 3 on host node-b.invalid (runner pid 12, torchrun pid 34): not checkable from "
        f"{socket.gethostname()}"
    )


def test_a_finished_run_with_pids_records_says_so(tmp_path):
    run_dir = Path(shutil.copytree(FIXTURE, tmp_path / "run_chain_small")).resolve()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    record = {"host": socket.gethostname(), "node_rank": 0, "runner_pid": dead.pid, "torchrun_pid": dead.pid,
              "started": time.time(), "ended": time.time(), "returncode": 0}  # fmt: skip
    (run_dir / "stages" / "3" / PIDS_FILE).write_text(json.dumps(record))
    assert dict(status_lines(collect_status(run_dir)))["processes"] == "none (the run finished)"


def dead_pid() -> int:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    return gone.pid


def record_dead_stage(run_dir: Path, *, runner_pid: int, started: float | None = None) -> float:
    """Stage 3's pids record of a runner and torchrun that are gone; returns its start time."""
    started = time.time() - 5 if started is None else started
    record = {"host": socket.gethostname(), "node_rank": 0, "runner_pid": runner_pid, "started": started}
    record["torchrun_pid"] = dead_pid()
    (run_dir / "stages" / "3" / PIDS_FILE).write_text(json.dumps(record))
    return started


def test_a_run_whose_processes_are_gone_is_failed_stopped_or_killed_not_running(tmp_path):
    run_dir = running_copy(tmp_path)
    runner = dead_pid()
    started = record_dead_stage(run_dir, runner_pid=runner)
    assert dict(status_lines(collect_status(run_dir)))["stage"] == (
        f"3 of 3 (killed: runner pid {runner} is gone and recorded no end (SIGKILL or a lost machine); the "
        f"same command resumes the run)"
    )

    def ended(error: BaseException | None) -> str:
        record_runner_end(run_dir, error)
        end = json.loads((run_dir / "runner_end.json").read_text())
        (run_dir / "runner_end.json").write_text(json.dumps(end | {"pid": runner, "ended": started + 2}))
        return dict(status_lines(collect_status(run_dir)))["stage"]

    diverged = LaunchError(
        "stage 3: rank 0 failed: TrainingDiverged: training diverged at iteration 7\nend of log"
    )
    assert (
        ended(diverged)
        == "3 of 3 (failed: stage 3: rank 0 failed: TrainingDiverged: training diverged at iteration 7)"
    )
    assert (
        ended(RunStopped(signal.SIGTERM)) == "3 of 3 (stopped by SIGTERM; the same command resumes the run)"
    )
    later = started + 10  # a later runner's launch, then killed: the older end is not its own
    record_dead_stage(run_dir, runner_pid=dead_pid(), started=later)
    assert "(killed: runner pid" in dict(status_lines(collect_status(run_dir)))["stage"]


def test_a_runner_that_failed_before_launching_a_stage_is_failed(tmp_path):
    run_dir = running_copy(tmp_path)  # no pids record: no stage was launched
    record_runner_end(run_dir, LaunchError("port 29500 is in use"))
    assert dict(status_lines(collect_status(run_dir)))["stage"] == "3 of 3 (failed: port 29500 is in use)"


def test_status_names_the_newest_periodic_checkpoint_of_a_killed_stage(tmp_path, monkeypatch):
    run_dir = running_copy(tmp_path)
    state = load_state(run_dir)
    save_state(run_dir, state.with_stage(dataclasses.replace(state.stage(3), checkpoint=None)))
    monkeypatch.chdir(tmp_path)  # the fixture's workdir is relative
    layout = tmp_path / "work/checkpoints/run_chain_small/gpt-tiny/z1/fp32/tp2_pp1_dp2_sp1"
    (layout / "global_step150").mkdir(parents=True)
    (layout / "global_step160").mkdir()  # a save still in flight is no checkpoint: latest names 150
    (layout / "latest").write_text("global_step150\n")
    lines = dict(status_lines(collect_status(run_dir)))
    assert lines["checkpoint"] == f"{layout.relative_to(tmp_path)}/global_step150"
    assert (
        lines["markers"] == "latest -> global_step150, latest_universal missing"
    )  # a later stage may need it


def test_a_finished_run_is_not_flagged_for_a_missing_latest_universal(tmp_path, monkeypatch):
    run_dir = Path(shutil.copytree(FIXTURE, tmp_path / "run_chain_small")).resolve()
    monkeypatch.chdir(tmp_path)
    layout = tmp_path / "work/checkpoints/run_chain_small/gpt-tiny/z1/fp32/tp2_pp1_dp2_sp1"
    (layout / "global_step180").mkdir(parents=True)
    (layout / "latest").write_text("global_step180\n")
    lines = dict(status_lines(collect_status(run_dir)))
    assert lines["stage"] == "3 of 3 (finished)" and lines["markers"] == "latest -> global_step180"
