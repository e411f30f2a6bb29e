"""A diverging run stops with a clear line and a non-zero exit instead of ending "completed"."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from test_train_cli import train_args, write_tiny_setup

from cona.runner.views.status import collect_status, status_lines


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_run_at_a_huge_lr_exits_non_zero_naming_the_divergence(tmp_path, capfd):
    config = write_tiny_setup(tmp_path)
    raw = json.loads(config.read_text())
    raw["training"].update(base_lr=1e3, base_min_lr=1e2, log_interval=2, eval_interval=1000)
    config.write_text(json.dumps(raw))
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
