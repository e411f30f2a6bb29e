"""Kills between two of the runner's writes, where a rerun of the same command must still finish. A kill is
stood in for by an exception the runner does not catch, raised at the point between the writes; the rerun must
finish, each sample trained once, in order."""

from __future__ import annotations

import dataclasses

import pytest
from tests.helpers.observed import TRACE_ENV, assert_each_sample_once_in_order
from tests.helpers.tiny_runs import free_port_base, in_place_run, write_chain
from tests.helpers.tiny_runs import free_port_base as chain_port_base

from cona import run_files
from cona.cli import main
from cona.runner import driver as driver_module
from cona.runner.schedules.online import run_online
from cona.runner.state import load_state
from cona.runner.views import run_tracker as run_tracker_module
from cona.runner.worker_session import WorkerSession


class Killed(BaseException):
    """The stand-in for a SIGKILL of the runner: nothing after the point it is raised at runs."""


@pytest.fixture(autouse=True)
def step_trace(monkeypatch):
    for name, value in TRACE_ENV.items():  # the workers record what they train on
        monkeypatch.setenv(name, value)


@pytest.mark.slow
@pytest.mark.multiproc
def test_an_online_run_killed_after_recording_an_in_place_switch_reruns_to_the_end(tmp_path, monkeypatch):
    """The state names the new stage, the switch request is still on disk: the rerun's retraining of the
    stage before (to rebuild what the in-place switch kept in memory) read that request at its first step
    and stopped there, and every rerun failed so ("the retraining did not end at ...")."""
    run, _ = in_place_run(tmp_path, total_iters=40)

    def killed(self, **kwargs):  # after the state that adds the stage is saved, before the request goes
        raise Killed

    monkeypatch.setattr(run_tracker_module.RunTracker, "switch", killed)
    with pytest.raises(Killed), WorkerSession() as session:
        run_online(run, launcher=session, out=lambda line: None)
    monkeypatch.undo()
    for name, value in TRACE_ENV.items():
        monkeypatch.setenv(name, value)
    assert run_files.switch_request_path(run.run_dir).is_file()
    assert [stage.status for stage in load_state(run.run_dir).stages] == ["trained", "pending"]
    first_result = run_files.stage_result_path(run.run_dir, 1)
    as_trained = first_result.read_bytes()

    with WorkerSession() as session:  # the same command again
        state = run_online(dataclasses.replace(run, base_port=free_port_base()), launcher=session, out=print)
    assert state.stages[-1].last_iteration == 40
    assert_each_sample_once_in_order(run.run_dir, total_samples=state.stages[-1].consumed_samples)
    # The retraining's result has a file of its own: stage 1's (its timings, for the summary) is kept.
    assert first_result.read_bytes() == as_trained
    assert (first_result.parent / run_files.REPLAY_RESULT).is_file()


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_chain_killed_before_recording_a_handed_over_stage_reruns_to_the_end(
    tmp_path, monkeypatch, tiny_config_file
):
    """Stage 1 wrote its result (handed over in place) and the runner died before recording it: the rerun
    took that result as handed over by workers that were gone, and stage 2 failed ("no earlier stage's
    state is in memory"); a second rerun was needed."""
    config = tiny_config_file(data="markov")
    steps = [
        {"dp": 2, "tp": 1, "pp": 1, "gbs": 8, "mbs": 4, "train_iters": 3, "is_initial": True},
        {"dp": 2, "tp": 1, "pp": 1, "gbs": 16, "mbs": 4, "extra_iters": 3},
    ]
    chain = write_chain(tmp_path / "chain.json", steps)
    argv = ["train", "--chain", str(chain), "--config", str(config), "--gpus", "2", "--quiet"]
    argv += ["--workdir", str(tmp_path / "work"), "--run-name", "in-place", "--switch-in-place"]
    original = driver_module.trained

    def killed(stage, *rest):  # the result is on disk, the runner dies before recording it
        if stage.step_num == 1:
            raise Killed
        return original(stage, *rest)

    monkeypatch.setattr(driver_module, "trained", killed)
    with pytest.raises(Killed):
        main([*argv, "--master-port-base", str(chain_port_base(len(steps)))])
    monkeypatch.setattr(driver_module, "trained", original)

    assert main([*argv, "--master-port-base", str(chain_port_base(len(steps)))]) == 0
    run_dir = tmp_path / "logs" / "in-place"
    state = load_state(run_dir)
    assert state.stages[-1].last_iteration == 6 and state.stages[-1].consumed_samples == 3 * 8 + 3 * 16
    assert_each_sample_once_in_order(run_dir, total_samples=3 * 8 + 3 * 16)
