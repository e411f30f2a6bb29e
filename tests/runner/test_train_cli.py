"""``cona train --dp --tp --pp ...``: refusals before launch, and one real stage on 2 CPU processes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tests.helpers.tiny_runs import train_args

from cona.cli import main
from cona.commands.train_runs import node_gpu_names

METRIC_FIELDS = {
    "stage",
    "iteration",
    "consumed_samples",
    "consumed_tokens",
    "loss",
    "lr",
    "gbs",
    "mbs",
    "dp",
    "tp",
    "pp",
    "step_time_s",
    "tokens_per_s",
    "mfu",
    "grad_norm",
    "gns_small_sqr",
    "gns_big_sqr",
    "gns_small_batch",
    "gns_big_batch",
    "time",
}


def test_a_bad_layout_is_refused_before_anything_is_launched(tmp_path, capsys, tiny_config_file):
    config = tiny_config_file(data="random")
    assert main(train_args(config, tmp_path / "work", dp=1, tp=3)) == 1
    err = capsys.readouterr().err
    assert err.startswith("cona: error: ") and "tp" in err and "heads" in err
    assert not (tmp_path / "logs").exists()  # nothing was started
    assert main(train_args(config, tmp_path / "work", dp=3, gbs=8, mbs=2)) == 1
    assert "gbs" in capsys.readouterr().err


def test_a_checkout_path_with_the_native_backend_is_refused(tmp_path, capsys):
    assert main(["train", "--backend", "native", "--repo-path", str(tmp_path)]) == 2
    assert "--repo-path names a Megatron-DeepSpeed checkout" in capsys.readouterr().err


def test_workdir_defaults_to_the_current_directory_in_every_mode(tmp_path, monkeypatch, tiny_config_file):
    config = tiny_config_file(data="random")
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    captured = []
    monkeypatch.setattr("cona.runner.fixed.run_fixed", lambda run, console: captured.append(run))
    monkeypatch.setattr("cona.runner.schedules.online.run_online", lambda run, **_: captured.append(run))
    fixed = ["--dp", "1", "--tp", "1", "--pp", "1", "--gbs", "8", "--mbs", "2", "--iters", "1"]
    online = ["--gpus", "1", "--system", "cpu_gloo", "--initial-gbs", "2", "--total-iters", "2"]
    for mode in (fixed, online):
        assert main(["train", "--config", str(config), *mode, "--device", "cpu"]) == 0
    assert [run.workdir for run in captured] == [tmp_path / "here"] * 2


def test_an_online_run_warns_when_its_system_does_not_describe_its_devices(
    tmp_path, monkeypatch, capsys, tiny_config_file
):
    config = tiny_config_file(data="random")
    monkeypatch.setattr("cona.runner.schedules.online.run_online", lambda run, **_: None)
    online = ["--gpus", "2", "--initial-gbs", "4", "--total-iters", "6", "--device", "cpu"]
    assert main(["train", "--config", str(config), *online, "--system", "a100_80g_2gpu_node"]) == 0
    assert capsys.readouterr().err == (
        "cona: warning: --system a100_80g_2gpu_node describes GPUs, but this run trains on the CPU: its "
        "predictions are for another machine (--system cpu_gloo describes CPU workers)\n"
    )
    assert main(["train", "--config", str(config), *online, "--system", "cpu_gloo"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_the_gpu_names_come_from_the_driver_without_starting_cuda(tmp_path):
    for number, model in enumerate(["NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3"]):
        (tmp_path / f"0000:0{number}:00.0").mkdir()
        (tmp_path / f"0000:0{number}:00.0" / "information").write_text(f"Model: \t\t {model}\nIRQ: 1\n")
    assert node_gpu_names(tmp_path) == ["NVIDIA H100 80GB HBM3"] * 2
    assert node_gpu_names(tmp_path / "none") == []


def test_missing_fixed_strategy_flags_are_named(tmp_path, capsys):
    assert main(["train", "--dp", "2"]) == 2
    err = capsys.readouterr().err
    assert "missing --tp, --pp, --gbs, --mbs, --iters " in err  # --workdir defaults to the cwd


@pytest.mark.slow
@pytest.mark.multiproc
def test_train_runs_one_stage_on_two_cpu_processes(tmp_path, capfd, tiny_config_file):
    config = tiny_config_file(data="random")
    assert main(train_args(config, tmp_path / "work", "--run-name", "e2e")) == 0
    out = capfd.readouterr().out
    run_dir = (tmp_path / "logs" / "e2e").resolve()
    assert out.splitlines()[0] == f"run directory: {run_dir}"
    assert (tmp_path / "logs" / "latest").resolve() == run_dir
    assert "stage 1 iter      2 | loss" in out  # the console line of a log interval

    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["iteration"] for line in lines] == [2, 4]
    for line in lines:
        assert line.keys() >= METRIC_FIELDS
        assert line["gbs"] == 8 and line["dp"] == 2 and line["mfu"] is None  # no MFU on a CPU
        assert np.isfinite(line["loss"]) and 0 < line["loss"] < 10 and line["eval_ppl"] > 1
    assert lines[-1]["consumed_samples"] == 32 and lines[-1]["consumed_tokens"] == 32 * 16

    result = json.loads((run_dir / "stages" / "1" / "stage_result.json").read_text())
    assert result["reason"] == "completed" and result["last_iteration"] == 4
    layout = tmp_path / "work" / "checkpoints" / "e2e" / "gpt-tiny" / "z1" / "fp32" / "tp1_pp1_dp2_sp1"
    assert Path(result["checkpoint"]) == layout / "global_step4"
    assert (layout / "latest").read_text().strip() == "global_step4"
    assert (run_dir / "stages" / "1" / "rank1.log").exists()


@pytest.mark.slow
@pytest.mark.multiproc
def test_the_steps_before_the_first_line_are_measured_and_listed(tmp_path, tiny_config_file):
    """One process, one micro-batch a step: a measured step runs as two halves. Steps 2-4 (the first stays
    whole) are measured and listed on the first line, whose noise-scale inputs are their means; the next
    line measures its last step only."""
    config = tiny_config_file(data="random")
    logging = ("--set", "training.log_interval=4", "--set", "training.eval_interval=8")
    args = train_args(config, tmp_path / "work", "--run-name", "first", *logging, dp=1, gbs=4, mbs=4, iters=8)
    assert main(args) == 0
    run_dir = tmp_path / "logs" / "first"
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["iteration"] for line in lines] == [4, 8]
    steps = np.asarray(lines[0]["gns_steps"])
    assert steps.shape == (3, 2) and np.all(steps > 0)
    assert steps.mean(axis=0) == pytest.approx([lines[0]["gns_small_sqr"], lines[0]["gns_big_sqr"]])
    assert "gns_steps" not in lines[1] and lines[1]["gns_small_sqr"] > 0
    # The first step's seconds are on the line that holds it, and within that line's time.
    assert 0 < lines[0]["first_step_s"] < lines[0]["step_time_s"] * lines[0]["steps_in_interval"]
    assert "first_step_s" not in lines[1]


@pytest.mark.multiproc
def test_a_data_error_fails_the_command_with_one_line_before_any_worker(tmp_path, capfd, tiny_config_file):
    # (A worker's own failure, named by stage and rank, is test_worker_session's failing-stage test.)
    config = tiny_config_file(data="random")
    bin_path = tmp_path / "data" / "tiny.bin"
    bin_path.write_bytes(bin_path.read_bytes()[:100])  # the index now points past the end of the data
    assert main(train_args(config, tmp_path / "work")) != 0
    err = capfd.readouterr().err
    assert err.count(f"cona: error: {bin_path}: 100 bytes, shorter than") == 1
    assert err.count("Traceback") == 0
    assert not (tmp_path / "logs").exists() or not list((tmp_path / "logs").rglob("rank0.log"))
