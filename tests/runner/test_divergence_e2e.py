"""A diverging run stops with a clear line and a non-zero exit instead of ending "completed"."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from tests.helpers.tiny_runs import train_args

from cona.runner.views.status import collect_status, status_lines


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_run_at_a_huge_lr_exits_non_zero_naming_the_divergence(tmp_path, capfd, tiny_config_file):
    config = tiny_config_file(
        data="random", training={"base_lr": 1e3, "base_min_lr": 1e2, "log_interval": 2, "eval_interval": 1000}
    )
    # its own process: once it exited, no process of the run is alive (status reads the run's end)
    done = subprocess.run([sys.executable, "-m", "cona", *train_args(config, tmp_path / "work", iters=60)])
    assert done.returncode != 0
    err = capfd.readouterr().err
    assert "failed: TrainingDiverged: training diverged at iteration" in err, err
    run_dir = next((tmp_path / "logs").glob("*/metrics.jsonl")).parent
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["iteration"] < 60  # it stopped, it did not train to the end
    stage = dict(status_lines(collect_status(run_dir)))["stage"]  # not "running", as its run state says
    assert stage.startswith("1 of 1 (failed: stage 1: ") and "TrainingDiverged" in stage, stage


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_climb_under_the_stop_factor_never_becomes_latest_and_the_rerun_is_refused(
    tmp_path, capfd, tiny_config_file
):
    """At base_lr 1.2 the loss climbs 6 -> 17 -> 29 before the 10x stop: the periodic checkpoints of that
    climb are written (the one in flight at the stop too, no temporary left) but ``latest`` stays on a
    state whose loss is within 2x the lowest, and the same command is refused until --resume-diverged."""
    from cona.cli import main

    config = tiny_config_file(
        data="random",
        training={
            "base_lr": 1.2,
            "base_min_lr": 0.1,
            "log_interval": 1,
            "eval_interval": 1000,
            "save_interval": 1,
        },
    )
    args = train_args(config, tmp_path / "work", "--run-name", "climb", dp=1, mbs=8, iters=30)
    assert main(args) != 0
    assert "TrainingDiverged: training diverged at iteration" in capfd.readouterr().err
    layout = next((tmp_path / "work" / "checkpoints" / "climb").glob("*/*/*/*"))
    assert not list(layout.glob(".tmp-*"))
    published = sorted(layout.glob("global_step*"))
    latest = json.loads((layout / (layout / "latest").read_text().strip() / "trainer_state.json").read_text())
    assert latest["loss"] <= 2 * latest["lowest_loss"]
    unfit = [json.loads((path / "trainer_state.json").read_text()) for path in published]
    assert any(state["loss"] > 2 * state["lowest_loss"] for state in unfit)  # written, never latest
    assert main(args) == 1
    refusal = capfd.readouterr().err
    assert "cona: error: stage 1 stopped diverged (training diverged at iteration" in refusal
    assert (
        f"--resume-diverged to resume it from {layout / (layout / 'latest').read_text().strip()}" in refusal
    )
