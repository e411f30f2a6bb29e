"""Two runs in one workdir keep their checkpoints: the run's name is part of the checkpoint path
(``<workdir>/checkpoints/<run_name>/...``), so two fixed runs of the same model and layout, each under its
own --run-name, save side by side; ``cona status`` of each names its own; a rerun finds its own state, and
--fresh starts one run over without touching the other's (the tiny GPT on 2 CPU processes, torchrun, gloo)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.helpers.tiny_runs import train_args

from cona.cli import main
from cona.engine.checkpoint.paths import tmp_owner
from cona.runner.views.status import collect_status, status_lines


def layout_of(workdir: Path, run_name: str) -> Path:
    return workdir / "checkpoints" / run_name / "gpt-tiny" / "z1" / "fp32" / "tp1_pp1_dp2_sp1"


def saved(layout: Path) -> dict[str, float]:
    """Each checkpoint file of the layout folder with its modification time."""
    return {
        str(path.relative_to(layout)): path.stat().st_mtime for path in layout.rglob("*") if path.is_file()
    }


@pytest.mark.slow
@pytest.mark.multiproc
def test_two_runs_in_one_workdir_keep_their_checkpoints(tmp_path, capfd, tiny_config_file):
    config = tiny_config_file(data="random")
    workdir = tmp_path / "work"
    names = ("first", "second")
    for name in names:
        assert main(train_args(config, workdir, "--run-name", name, iters=2)) == 0
    for name in names:
        layout, run_dir = layout_of(workdir, name), tmp_path / "logs" / name
        assert (layout / "latest").read_text().strip() == "global_step2"
        trainer_state = json.loads((layout / "global_step2" / "trainer_state.json").read_text())
        assert trainer_state["run"] == tmp_owner(run_dir)  # each saved its own, neither replaced the other
        lines = dict(status_lines(collect_status(run_dir)))
        assert lines["checkpoint"] == str(layout / "global_step2")
        assert lines["markers"] == "latest -> global_step2"  # a finished run needs no universal one
    second = saved(layout_of(workdir, "second"))
    capfd.readouterr()

    assert main(train_args(config, workdir, "--run-name", "second", iters=2)) == 0  # its own state: done
    assert "run second already finished at iteration 2" in capfd.readouterr().out
    first = saved(layout_of(workdir, "first"))
    assert main(train_args(config, workdir, "--run-name", "first", "--fresh", iters=2)) == 0
    out = capfd.readouterr().out
    assert "starting run first" in out and "already finished" not in out
    retrained = saved(layout_of(workdir, "first"))
    assert retrained["global_step2/trainer_state.json"] > first["global_step2/trainer_state.json"]
    assert saved(layout_of(workdir, "second")) == second  # the other run's checkpoint is untouched
