"""Launching a stage: the torchrun command, its environment, ports, the run directory, and how a failed
stage is reported (the first failing rank's error, once)."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from pathlib import Path

import pytest
from tests.helpers.tiny import tiny_raw
from tests.helpers.torchrun_util import free_port

from cona.config import parse_config
from cona.config.file import load_config
from cona.engine.spec import StageResult, StageSpec
from cona.errors import LaunchError
from cona.runner import launch
from cona.runner.launch import (
    ANY_FREE_PORT,
    DEFAULT_MASTER_PORT_BASE,
    Topology,
    check_port_free,
    describe_failure,
    resolve_port_base,
    run_stage,
    stage_master_port,
    torchrun_command,
    worker_env,
)
from cona.runner.run_dir import (
    check_run_name,
    create_run_dir,
    point_latest,
    resolve_latest,
    resolve_log_root,
    stage_dir,
)
from cona.strategy import Strategy


def test_a_watched_stage_is_seen_to_end_as_it_exits_not_at_the_next_watch():
    """The console watches a stage about twice a second; the runner must not wait out the interval after
    torchrun exits, since a switch through a checkpoint starts the next stage only then."""
    watched: list[float] = []
    started = time.monotonic()
    process = subprocess.Popen(["/bin/sh", "-c", "sleep 0.1; exit 3"])
    assert launch._wait(process, lambda: watched.append(time.monotonic())) == 3
    assert watched and time.monotonic() - started < 0.8 * launch._WATCH_INTERVAL_S


def test_torchrun_command_names_topology_and_worker(tmp_path):
    topology = Topology(nproc_per_node=4, master_port=29501, master_addr="10.0.0.2", nnodes=3, node_rank=2)
    command = torchrun_command(tmp_path / "spec.json", topology, python="/usr/bin/python3")
    assert command[:3] == ["/usr/bin/python3", "-m", "torch.distributed.run"]
    pairs = dict(zip(command[3:-3:2], command[4:-3:2], strict=True))
    assert pairs == {
        "--nnodes": "3",
        "--node-rank": "2",
        "--nproc-per-node": "4",
        "--master-addr": "10.0.0.2",
        "--master-port": "29501",
        "--max-restarts": "0",
    }
    assert command[-3:] == ["-m", "cona.engine.worker", str(tmp_path / "spec.json")]
    assert topology.world_size == 12


def test_without_a_port_torchrun_picks_a_free_one_on_one_node_only(tmp_path):
    topology = Topology(nproc_per_node=2, master_port=stage_master_port(None, 3))
    command = torchrun_command(tmp_path / "spec.json", topology, python="python")
    assert command[3:7] == ["--standalone", "--nproc-per-node", "2", "--max-restarts"]
    assert not any(arg.startswith(("--master", "--nnodes", "--node-rank")) for arg in command)
    with pytest.raises(LaunchError, match="across 2 nodes needs an explicit master port"):
        Topology(nproc_per_node=2, master_port=ANY_FREE_PORT, nnodes=2)


def test_the_port_base_is_explicit_when_given_or_across_nodes():
    assert resolve_port_base(31000, 1) == 31000 and resolve_port_base(31000, 2) == 31000
    assert resolve_port_base(None, 2) == DEFAULT_MASTER_PORT_BASE
    assert resolve_port_base(None, 1) is None


def test_worker_env_shares_cores_and_hides_gpus_on_cpu():
    env = worker_env({"PATH": "/bin"}, device_type="cpu", nproc_per_node=2, cpu_count=8)
    assert env["OMP_NUM_THREADS"] == "4" and env["PYTHONUNBUFFERED"] == "1" and env["PATH"] == "/bin"
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    assert worker_env({}, device_type="cpu", nproc_per_node=4, cpu_count=2)["OMP_NUM_THREADS"] == "1"
    gpu = worker_env({"CUDA_VISIBLE_DEVICES": "0,1"}, device_type="cuda", nproc_per_node=2, cpu_count=32)
    assert gpu["CUDA_VISIBLE_DEVICES"] == "0,1" and gpu["OMP_NUM_THREADS"] == "16"


def test_master_port_follows_the_stage_and_must_be_free():
    assert stage_master_port(29400, 3) == 29403
    with pytest.raises(LaunchError, match="outside"):
        stage_master_port(65535, 1)
    with socket.socket() as listener:
        listener.bind(("", 0))
        listener.listen()
        with pytest.raises(LaunchError, match=f"port {listener.getsockname()[1]} is in use"):
            check_port_free(listener.getsockname()[1])


def test_run_dir_is_created_once_and_latest_follows_the_newest(tmp_path):
    name = "first"
    first = create_run_dir(tmp_path / "logs", name)
    assert first.is_dir() and resolve_latest(tmp_path / "logs") == first
    second = create_run_dir(tmp_path / "logs", "second")
    assert resolve_latest(tmp_path / "logs") == second
    assert (tmp_path / "logs" / "latest").is_symlink()
    with pytest.raises(LaunchError, match="already exists"):
        create_run_dir(tmp_path / "logs", name)
    assert stage_dir(second, 2) == second / "stages" / "2" and (second / "stages" / "2").is_dir()


def test_latest_falls_back_to_a_marker_file_without_symlinks(tmp_path, monkeypatch):
    run = tmp_path / "logs" / "run-a"
    run.mkdir(parents=True)

    def no_symlinks(self, *args, **kwargs):
        raise OSError("symlinks not supported")

    monkeypatch.setattr(Path, "symlink_to", no_symlinks)
    latest = point_latest(run)
    assert latest.is_file() and latest.read_text().strip() == "run-a"
    assert resolve_latest(tmp_path / "logs") == run.resolve()


def test_a_relative_log_root_is_taken_from_the_config_directory(tmp_path, monkeypatch):
    raw = tiny_raw()
    monkeypatch.chdir(tmp_path)
    config = resolve_log_root(parse_config(raw, source=tmp_path / "project" / ".conaconfig"))
    assert config.training.logging.log_root == str(tmp_path / "project" / "logs")
    absolute = resolve_log_root(config)
    assert absolute == config


@pytest.mark.parametrize("bad", ["", "latest", "../up", "a/b", "-x", "has space"])
def test_bad_run_names_are_refused(bad):
    with pytest.raises(LaunchError, match="--run-name"):
        check_run_name(bad)


def test_failure_names_the_rank_that_failed_first(tmp_path):
    for rank, when, kind in (
        (0, 20.0, "DistBackendError"),
        (1, 10.0, "DataError"),
        (2, 30.0, "RuntimeError"),
    ):
        record = {
            "rank": rank,
            "time": when,
            "type": kind,
            "message": f"problem on {rank}",
            "traceback": "...",
        }
        (tmp_path / f"rank{rank}.error").write_text(json.dumps(record))
    message = describe_failure(tmp_path, 1)
    assert f"stage {tmp_path.name}: rank 1 failed: DataError: problem on 1" in message
    assert "ranks [0, 2] failed after it" in message


def test_failure_without_error_files_shows_the_root_cause_rank_log(tmp_path):
    (tmp_path / "torchrun.log").write_text(
        "...\nRoot Cause (first observed failure):\n[0]:\n  rank      : 1 (local)\n"
    )
    (tmp_path / "rank1.log").write_text("step 1\nSegmentation fault\n")
    message = describe_failure(tmp_path, -11)
    assert "rank 1 failed (torchrun exit code -11)" in message and "Segmentation fault" in message


TORCHRUN_KILLED_RANK_1 = """...
Failures:
[1]:
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 11671)
  error_file: <N/A>
-------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-01_12:00:08
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 11672)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 11672
"""
"""torchrun's report (as torch 2.13 writes it) when rank 1 was SIGKILLed and rank 0 then failed."""


def test_a_killed_rank_is_named_not_the_rank_that_lost_its_connection(tmp_path):
    record = {"rank": 0, "time": 5.0, "type": "DistBackendError", "message": "Connection reset by peer"}
    (tmp_path / "rank0.error").write_text(json.dumps({**record, "traceback": "..."}))
    (tmp_path / "torchrun.log").write_text(TORCHRUN_KILLED_RANK_1)
    message = describe_failure(tmp_path, 1)
    named = f"stage {tmp_path.name}: rank 1 was killed by SIGKILL (it wrote no error"
    assert message.startswith(named), message
    assert "ranks [0] failed after it" in message
    # A rank that reported its own error is named as before, whatever torchrun's root cause says.
    (tmp_path / "rank1.error").write_text(json.dumps({**record, "rank": 1, "time": 4.0, "type": "DataError"}))
    assert "rank 1 failed: DataError" in describe_failure(tmp_path, 1)


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_switch_request_stops_the_stage_after_the_step_with_a_checkpoint(tmp_path, tiny_config_file):

    config = resolve_log_root(load_config(tiny_config_file(data="random")))
    run_dir = create_run_dir(Path(config.training.logging.log_root), "switch")
    spec = StageSpec(
        run_dir=run_dir,
        config=config,
        strategy=Strategy(dp=2, tp=1, pp=1, mbs=2, gbs=8),
        stage=1,
        workdir=tmp_path / "work",
        planned_tokens=10 * 8 * 16,
        target_iteration=10,
    )
    spec.switch_request_path.write_text(json.dumps({"reason": "test"}))
    spec_path = spec.write(stage_dir(run_dir, 1) / "spec.json")
    run_stage(
        spec_path, spec.stage_dir, Topology(nproc_per_node=2, master_port=free_port()), device_type="cpu"
    )
    result = StageResult.read(spec.result_path)
    assert (result.reason, result.last_iteration, result.consumed_samples) == ("switch_requested", 1, 8)
    assert result.checkpoint is not None and Path(result.checkpoint).name == "global_step1"
    assert {"launch", "process_start", "setup_done", "first_step_done", "save_done"} <= result.timings.keys()
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["iteration"] for line in lines] == [1]  # the partial interval is logged
