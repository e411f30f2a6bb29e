"""Periodic checkpoints (``training.save_interval``): a fixed run and a chain killed by SIGKILL in the middle
of a stage, once a periodic checkpoint of that stage is published, resume with the same command from it and
end with the samples and losses of an uninterrupted run (the tiny GPT on 2 CPU processes, torchrun, gloo).
Runner, torchrun and workers die together (kill_mid_stage_worker.py)."""

from __future__ import annotations

import functools
import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest
from tests.helpers.forked import killed_in_own_process_group
from tests.helpers.observed import TRACE_ENV, assert_each_sample_once_in_order, trained_steps
from tests.helpers.paths import WORKERS
from tests.helpers.tiny_runs import chain_args, final_records, free_port_base, train_args, write_chain
from tests.helpers.workers.kill_mid_stage_worker import KILL_AT_ENV, KILL_STAGE_ENV, ONCE_SAVED_ENV

from cona.cli import main
from cona.commands import train_runs
from cona.engine.spec import StageSpec
from cona.runner import stage_run
from cona.runner.launch import run_stage
from cona.runner.schedules.chain_schedule import run_chain
from cona.runner.stage_run import StageLaunch
from cona.runner.state import SWITCH_IN_PARTS, durations
from cona.runner.views.status import collect_status, status_lines
from cona.runner.worker_session import WorkerSession, stage_launcher

PERIODIC = {"save_interval": 2, "keep_checkpoints": 2}


def kill_env(*, stage: int, at: int, once_saved: int) -> dict[str, str]:
    python_path = [str(WORKERS), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {
        KILL_STAGE_ENV: str(stage),
        KILL_AT_ENV: str(at),
        ONCE_SAVED_ENV: str(once_saved),
        "PYTHONPATH": os.pathsep.join(python_path),
    }


def switched_parts(milestones: dict) -> dict[str, float]:
    """The start parts of a switch that a stage's recorded milestones measure."""
    return {
        key: value
        for key, value in durations(milestones, milestones["launch"]).items()
        if key in SWITCH_IN_PARTS
    }


def newest_periodic(layout: Path) -> str:
    """The checkpoint ``latest`` names after the kill: stage 2's periodic one at 4 (published before the
    save at 6 began) or at 6 (when its write was done before the kill)."""
    newest = (layout / "latest").read_text().strip()
    assert newest in ("global_step4", "global_step6"), newest
    return newest


def assert_same_training(run_dir: Path, reference: Path, *, total_samples: int) -> None:
    """The same samples in the same order, each once, and the same losses as the uninterrupted run."""
    trained = assert_each_sample_once_in_order(run_dir, total_samples=total_samples)
    expected = trained_steps(reference)
    assert [step.sample_ids for step in trained] == [step.sample_ids for step in expected]
    assert [step.lr for step in trained] == pytest.approx([step.lr for step in expected], rel=1e-12)
    final, uninterrupted = final_records(run_dir), final_records(reference)
    assert sorted(final) == sorted(uninterrupted)
    np.testing.assert_allclose(
        [final[i]["loss"] for i in sorted(final)],
        [uninterrupted[i]["loss"] for i in sorted(final)],
        rtol=1e-6,
    )


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_killed_fixed_run_resumes_with_the_same_command_from_its_periodic_checkpoint(
    tmp_path, monkeypatch, capfd, tiny_config_file
):
    for name, value in TRACE_ENV.items():  # the workers record what they train on
        monkeypatch.setenv(name, value)
    config = tiny_config_file(data="random", training={**PERIODIC, "eval_interval": 1000})
    assert main(train_args(config, tmp_path / "whole", "--run-name", "whole", iters=8)) == 0
    reference = tmp_path / "logs" / "whole"
    whole_layout = (
        tmp_path / "whole" / "checkpoints" / "whole" / "gpt-tiny" / "z1" / "fp32" / "tp1_pp1_dp2_sp1"
    )
    # Periodic saves at 2, 4, 6 (the newest two kept), the stage's own at its end.
    assert sorted(p.name for p in whole_layout.glob("global_step*")) == ["global_step4", "global_step6",
                                                                         "global_step8"]  # fmt: skip
    capfd.readouterr()

    def killed_run() -> None:
        launcher = functools.partial(
            stage_run.torchrun_launcher,
            worker_module="kill_mid_stage_worker",
            env={**os.environ, **kill_env(stage=1, at=5, once_saved=4)},
        )
        stage_run.torchrun_launcher = launcher  # what run_fixed launches with
        main(train_args(config, tmp_path / "work", "--run-name", "killed", iters=8))

    wait_status = killed_in_own_process_group(killed_run)
    assert os.WIFSIGNALED(wait_status) and os.WTERMSIG(wait_status) == signal.SIGKILL, wait_status
    run_dir = tmp_path / "logs" / "killed"
    layout = tmp_path / "work" / "checkpoints" / "killed" / "gpt-tiny" / "z1" / "fp32" / "tp1_pp1_dp2_sp1"
    assert (layout / "global_step4").is_dir() and not (layout / "global_step8").exists()
    killed_at = max(step.iteration for step in trained_steps(run_dir))
    assert 5 <= killed_at < 8
    lines = dict(status_lines(collect_status(run_dir)))
    assert lines["stage"].startswith("1 of 1 (killed: runner pid ")
    assert lines["checkpoint"] == str(layout / newest_periodic(layout))  # not "none recorded yet"
    capfd.readouterr()

    # The same command again (on fresh ports: the killed stage's may still be held by the kernel).
    assert main(train_args(config, tmp_path / "work", "--run-name", "killed", iters=8)) == 0
    out = capfd.readouterr().out.splitlines()
    assert out[0] == f"run directory: {run_dir.resolve()} (resuming)"
    newest = (layout / "latest").read_text().strip()
    assert newest == "global_step8"
    spec = json.loads((run_dir / "stages" / "1" / "spec.json").read_text())
    assert spec["load_path"] in (str(layout / "global_step4"), str(layout / "global_step6"))
    assert_same_training(run_dir, reference, total_samples=8 * 8)
    assert not any(path.name.startswith(".tmp-") for path in layout.iterdir())


@pytest.mark.multiproc
def test_an_existing_directory_of_no_fixed_run_is_refused(tmp_path, capsys, tiny_config_file):
    config = tiny_config_file(data="random")
    (tmp_path / "logs" / "taken").mkdir(parents=True)
    assert main(train_args(config, tmp_path / "work", "--run-name", "taken")) != 0
    err = capsys.readouterr().err
    assert "holds no fixed run to resume; pick another --run-name" in err


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_chain_killed_mid_stage_resumes_from_the_stage_s_periodic_checkpoint(
    tmp_path, monkeypatch, tiny_config_file
):
    for name, value in TRACE_ENV.items():
        monkeypatch.setenv(name, value)
    config = tiny_config_file(data="markov", training=PERIODIC)
    steps = [
        {
            "dp": 2,
            "tp": 1,
            "pp": 1,
            "gbs": 8,
            "mbs": 4,
            "train_iters": 3,
            "is_initial": True,
            "convert": True,
        },
        {"dp": 1, "tp": 2, "pp": 1, "gbs": 16, "mbs": 4, "extra_iters": 5},
    ]
    total = 3 * 8 + 5 * 16
    chain = write_chain(tmp_path / "chain.json", steps)
    # The uninterrupted run in one worker session (one process start; it trains as the per-stage launch
    # does, test_worker_session), the killed one launching each stage.
    with stage_launcher(restart_workers=False) as launcher:
        run_chain(train_runs.chain_run(chain_args(config, chain, tmp_path / "whole", "whole", stages=2)),
                  launcher=launcher, out=lambda line: None)  # fmt: skip
    args = chain_args(config, chain, tmp_path, "kill", stages=2)

    def killing_launcher(launch: StageLaunch) -> None:
        run_stage(
            launch.spec_path,
            launch.spec.stage_dir,
            launch.topology,
            device_type=launch.device_type,
            quiet=True,
            worker_module="kill_mid_stage_worker",
            env={**os.environ, **kill_env(stage=2, at=7, once_saved=4)},
        )

    wait_status = killed_in_own_process_group(
        lambda: run_chain(train_runs.chain_run(args), launcher=killing_launcher, out=lambda line: None)
    )
    assert os.WIFSIGNALED(wait_status) and os.WTERMSIG(wait_status) == signal.SIGKILL, wait_status
    layout = tmp_path / "checkpoints" / "kill" / "gpt-tiny" / "z1" / "fp32" / "tp2_pp1_dp1_sp1"
    newest = newest_periodic(layout)
    switched = json.loads((tmp_path / "logs" / "kill" / "stages" / "2" / "switch_in.json").read_text())

    lines: list[str] = []
    args.master_port_base = free_port_base(2)
    state = run_chain(train_runs.chain_run(args), out=lines.append)
    # The switch 1->2 is charged what the killed attempt's start cost, not the rerun's start and its load of
    # stage 2's own periodic checkpoint (resume downtime).
    start = {
        key: state.stage(2).switch_cost[key] for key in SWITCH_IN_PARTS if key in switched_parts(switched)
    }
    assert start == pytest.approx(switched_parts(switched)) and "process_start_s" in start
    iteration = int(newest.removeprefix("global_step"))
    resumed_at = f"iteration={iteration}, consumed_samples={24 + (iteration - 3) * 16}"
    assert lines[0].startswith(f"resuming run kill at stage 2 (running) from {layout / newest}, {resumed_at}")
    assert [stage.status for stage in state.stages] == ["done", "done"]
    assert_same_training(tmp_path / "logs" / "kill", tmp_path / "logs" / "whole", total_samples=total)


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_stage_continued_in_place_and_killed_resumes_from_its_periodic_checkpoint(
    tmp_path, monkeypatch, tiny_config_file
):
    """An in-place stage has no checkpoint at its start: without a periodic one a kill would retrain stage 1
    up to the switch (:mod:`cona.runner.in_place`); with it, the stage resumes from it."""
    for name, value in TRACE_ENV.items():
        monkeypatch.setenv(name, value)
    config = tiny_config_file(data="markov", training=PERIODIC)
    first = {"dp": 2, "tp": 1, "pp": 1, "gbs": 8, "mbs": 4, "train_iters": 3, "is_initial": True}
    second = {"dp": 2, "tp": 1, "pp": 1, "gbs": 16, "mbs": 4, "extra_iters": 5}  # the same layout: in place
    chain = write_chain(tmp_path / "chain.json", [first, second])
    total = 3 * 8 + 5 * 16
    reference = chain_args(config, chain, tmp_path / "whole", "whole", stages=2)
    reference.switch_in_place = True
    with stage_launcher(restart_workers=False) as launcher:
        run_chain(train_runs.chain_run(reference), launcher=launcher, out=lambda line: None)
    args = chain_args(config, chain, tmp_path, "kill", stages=2)
    args.switch_in_place = True

    def killed_run() -> None:
        env = {**os.environ, **kill_env(stage=2, at=7, once_saved=4)}
        with WorkerSession(worker_module="kill_mid_stage_worker", env=env) as launcher:
            run_chain(train_runs.chain_run(args), launcher=launcher, out=lambda line: None)

    wait_status = killed_in_own_process_group(killed_run)
    assert os.WIFSIGNALED(wait_status) and os.WTERMSIG(wait_status) == signal.SIGKILL, wait_status
    run_dir = tmp_path / "logs" / "kill"
    assert StageSpec.read(run_dir / "stages" / "2" / "spec.json").continue_in_place
    layout = tmp_path / "checkpoints" / "kill" / "gpt-tiny" / "z1" / "fp32" / "tp1_pp1_dp2_sp1"
    newest = newest_periodic(layout)

    lines: list[str] = []
    args.master_port_base = free_port_base(2)
    with stage_launcher(restart_workers=False) as launcher:
        state = run_chain(train_runs.chain_run(args), launcher=launcher, out=lines.append)
    assert lines[0].startswith(f"resuming run kill at stage 2 (running) from {layout / newest}")
    assert not any("retraining" in line for line in lines), lines
    spec = StageSpec.read(run_dir / "stages" / "2" / "spec.json")
    assert not spec.continue_in_place and spec.load_path == layout / newest
    assert [stage.status for stage in state.stages] == ["done", "done"]
    assert_same_training(run_dir, tmp_path / "logs" / "whole", total_samples=total)


@pytest.mark.slow
@pytest.mark.multiproc
def test_saves_by_time_happen_at_the_step_rank_0_s_clock_picks_and_the_newest_are_kept(
    tmp_path, tiny_config_file
):
    """``save_interval_minutes`` alone: rank 0's clock decides, every rank saves at the same step (else the
    collective save would hang), at most ``keep_checkpoints`` periodic ones stay beside the last."""
    timed = {"save_interval": None, "save_interval_minutes": 1e-4, "keep_checkpoints": 1}
    config = tiny_config_file(data="random", training=timed)
    assert main(train_args(config, tmp_path / "work", "--run-name", "timed", iters=8)) == 0
    layout = tmp_path / "work" / "checkpoints" / "timed" / "gpt-tiny" / "z1" / "fp32" / "tp1_pp1_dp2_sp1"
    states = {
        path.name: json.loads((path / "trainer_state.json").read_text())
        for path in layout.glob("global_step*")
    }
    periodic = sorted(name for name, state in states.items() if state["periodic"])
    assert len(periodic) == 1 and periodic[0] != "global_step8", states.keys()
    assert (
        states["global_step8"]["periodic"] is False
        and (layout / "latest").read_text().strip() == "global_step8"
    )
    assert not any(path.name.startswith(".tmp-") for path in layout.iterdir())
