"""A run's identity across its invocations: the same fixed command finds its run again (its default name is
the strategy's), and the run has one W&B run, written by the runner, whose id is the run's own (the tiny GPT
on 2 CPU processes, torchrun, gloo; W&B offline)."""

from __future__ import annotations

import pytest
from tests.helpers.tiny_runs import train_args
from tests.helpers.wandb_offline import read_offline_run

from cona.cli import main
from cona.runner.run_dir import resolve_latest
from cona.runner.views.run_tracker import wandb_run_id


@pytest.mark.slow
@pytest.mark.multiproc
def test_the_same_fixed_command_finds_its_run_and_its_one_wandb_run(tmp_path, capfd, tiny_config_file):
    pytest.importorskip("wandb")
    config = tiny_config_file(data="random", training={"wandb_project": "cona-test", "wandb_mode": "offline"})
    assert main(train_args(config, tmp_path / "work", iters=2)) == 0  # no --run-name
    run_dir = resolve_latest(tmp_path / "logs")
    assert run_dir.name == "fixed-dp2_tp1_pp1_mbs2_gbs8-iters2"
    capfd.readouterr()

    assert main(train_args(config, tmp_path / "work", iters=2)) == 0  # the same command again
    out = capfd.readouterr().out
    assert f"run {run_dir.name} already finished at iteration 2" in out, out
    runs = [path.name for path in (tmp_path / "logs").iterdir() if not path.name.startswith(".")]
    assert sorted(runs) == ["fixed-dp2_tp1_pp1_mbs2_gbs8-iters2", "latest"]

    (folder,) = (run_dir / "wandb").glob("offline-run-*")  # one folder: no stage's, no empty "-cona" one
    run_id, rows = read_offline_run(folder)
    assert run_id == wandb_run_id(run_dir) and run_id.startswith(f"{run_dir.name}-")
    assert [row["iteration"] for row in rows if "train/loss" in row] == [2]
    assert [row["iteration"] for row in rows if "eval/ppl" in row] == [2]
