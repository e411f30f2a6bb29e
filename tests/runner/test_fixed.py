"""A fixed run (``cona train --dp .. --iters N``): the chain of one step, built in memory, with a fake engine
(chain_fakes.FakeEngine) in place of the workers. The same command resumes a killed run from its newest
checkpoint, whether its run directory holds only a run state or also a ``fixed_chain.json`` file."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tests.helpers.chain_fakes import FakeEngine, run_layout, write_fake_chain_config
from tests.helpers.forked import fork

from cona import run_files
from cona.api import TrainResult
from cona.config.file import load_config
from cona.errors import ChainError, LaunchError
from cona.runner.chain_file import FIXED_ORIGIN
from cona.runner.fixed import fixed_chain, one_stage_chain, open_run_dir
from cona.runner.run_descriptions import ChainRun, FixedRun
from cona.runner.run_dir import create_run_dir, resolve_log_root
from cona.runner.schedules.chain_schedule import run_chain
from cona.runner.state import load_state
from cona.strategy import Strategy

ITERS = 4
STRATEGY = Strategy(dp=4, tp=1, pp=1, mbs=2, gbs=8)


def fixed_run(workdir: Path, iters: int = ITERS) -> FixedRun:
    config = resolve_log_root(load_config(workdir / ".conaconfig"))
    return FixedRun(
        strategy=STRATEGY, iters=iters, config=config, workdir=workdir, device_type="cpu", run_name="run"
    )


def killed_mid_stage(chain_run: Callable[[], ChainRun]) -> None:
    """Run the chain in a forked child whose fake engine saves half-way through stage 1, then is killed."""
    pid = fork()
    if pid == 0:
        status = 3  # reaching the end means the kill never came
        try:
            torch.set_num_threads(1)
            run_chain(
                chain_run(), launcher=FakeEngine(kill_at="training", kill_stage=1), out=lambda line: None
            )
        except BaseException:  # noqa: BLE001 (any failure must end the child, not continue the test in it)
            status = 4
        finally:
            os._exit(status)
    _, wait_status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(wait_status) and os.WTERMSIG(wait_status) == signal.SIGKILL, wait_status


def as_older_cona_made_it(run: FixedRun) -> Callable[[], ChainRun]:
    """The run directory with the strategy written to ``fixed_chain.json`` and the chain read from that
    file, as cona versions that kept a fixed run's chain on disk ran it."""
    run_dir = create_run_dir(Path(run.config.training.logging.log_root), "run")
    chain_path = run_dir / run_files.FIXED_CHAIN
    chain_path.write_text(json.dumps(fixed_chain(run.strategy, run.iters)))
    return lambda: ChainRun(
        chain_path=chain_path,
        config=run.config,
        workdir=run.workdir,
        run_dir=run_dir,
        world_size=run.strategy.world_size,
        device_type=run.device_type,
    )


@pytest.mark.parametrize("made_by", ["this cona", "an older cona"])
def test_the_same_fixed_command_resumes_a_killed_run_from_its_checkpoint(tmp_path, capsys, made_by):
    write_fake_chain_config(tmp_path)
    run = fixed_run(tmp_path)
    if made_by == "this cona":
        run_dir = open_run_dir(run)
        killed_mid_stage(lambda: one_stage_chain(run, run_dir))
        assert sorted(path.name for path in run_dir.iterdir()) == [run_files.RUNNER_STATE, run_files.STAGES]
        assert load_state(run_dir).chain_path == FIXED_ORIGIN
    else:
        killed_mid_stage(as_older_cona_made_it(run))
        run_dir = tmp_path / "logs" / "run"
    before = {path.name: path.read_bytes() for path in run_dir.iterdir() if path.is_file()}
    capsys.readouterr()

    assert open_run_dir(run) == run_dir
    engine, lines = FakeEngine(), []
    state = run_chain(one_stage_chain(run, run_dir), launcher=engine, out=lines.append)
    assert capsys.readouterr().out == f"run directory: {run_dir} (resuming)\n"
    half = tmp_path / run_layout(1, 1, 4) / "global_step2"
    assert lines[0].startswith(f"resuming run run at stage 1 (running) from {half}, iteration=2")
    assert [launch.spec.load_path for launch in engine.launches] == [half]
    (stage,) = state.stages
    assert (stage.status, stage.target_iteration, stage.consumed_samples) == ("done", ITERS, ITERS * 8)
    after = {name: (run_dir / name).read_bytes() for name in before if name != run_files.RUNNER_STATE}
    assert after == {name: data for name, data in before.items() if name != run_files.RUNNER_STATE}
    made_here = made_by == "this cona"
    assert load_state(run_dir).chain_path == (
        FIXED_ORIGIN if made_here else str(run_dir / run_files.FIXED_CHAIN)
    )
    assert (run_dir / run_files.FIXED_CHAIN).exists() != made_here
    realized = None if made_here else run_dir.resolve() / run_files.FIXED_CHAIN  # a chain file, where one is
    assert TrainResult.read(run_dir).realized_chain == realized


def test_a_fixed_run_of_another_iters_under_the_same_name_is_refused(tmp_path):
    write_fake_chain_config(tmp_path)
    run = fixed_run(tmp_path)
    run_dir = open_run_dir(run)
    killed_mid_stage(lambda: one_stage_chain(run, run_dir))
    longer = fixed_run(tmp_path, iters=ITERS + 2)
    with pytest.raises(ChainError, match=f"step 1 of {FIXED_ORIGIN} changed after it started"):
        run_chain(one_stage_chain(longer, open_run_dir(longer)), launcher=FakeEngine(), out=lambda line: None)


def test_a_directory_that_holds_no_fixed_run_is_refused(tmp_path):
    write_fake_chain_config(tmp_path)
    run = fixed_run(tmp_path)
    taken = tmp_path / "logs" / "run"
    taken.mkdir(parents=True)
    with pytest.raises(LaunchError, match="already exists and holds no fixed run to resume"):
        open_run_dir(run)
    chain_path = tmp_path / "chain.json"
    chain_path.write_text(json.dumps(fixed_chain(STRATEGY, ITERS)))
    chain_run = ChainRun(
        chain_path=chain_path,
        config=run.config,
        workdir=tmp_path,
        run_dir=taken,
        world_size=4,
        device_type="cpu",
    )
    run_chain(chain_run, launcher=FakeEngine(), out=lambda line: None)  # a chain run of the same steps
    with pytest.raises(LaunchError, match="already exists and holds no fixed run to resume"):
        open_run_dir(run)
