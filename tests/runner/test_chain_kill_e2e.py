"""SIGKILL of a real chain (the tiny GPT on 2 CPU processes, torchrun, gloo) in the middle of the save that
hands stage 2 over to stage 3: every rank has written its shards, the checkpoint is not yet renamed into
place, so nothing is published. Runner, torchrun and workers die together (kill_in_save_worker.py).

Rerunning the same command resumes from the last complete checkpoint (stage 1's published copy), trains
stage 2 again from there and finishes the chain; over the whole run every training sample is used once
(no sample skipped or repeated across the kill), and the retrained iterations reproduce the losses of the
killed attempt, so the model they continue from is the same.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest
from tests.helpers.forked import killed_in_own_process_group
from tests.helpers.observed import TRACE_ENV, assert_each_sample_once_in_order, trained_steps
from tests.helpers.paths import WORKERS
from tests.helpers.tiny import MARKOV_SEQ as MARKOV_SEQ
from tests.helpers.tiny_runs import chain_args, free_port_base, write_chain
from tests.helpers.workers.kill_in_save_worker import KILL_STAGE_ENV

from cona.commands import train_runs
from cona.runner.launch import run_stage
from cona.runner.schedules.chain_schedule import run_chain
from cona.runner.stage_run import StageLaunch
from cona.runner.state import load_state
from cona.runner.worker_session import WorkerSession

STEPS = (
    {"dp": 2, "tp": 1, "pp": 1, "gbs": 8, "mbs": 4, "train_iters": 3, "is_initial": True, "convert": True},
    {"dp": 1, "tp": 2, "pp": 1, "gbs": 16, "mbs": 4, "extra_iters": 3, "convert": True},
    {"dp": 1, "tp": 1, "pp": 2, "gbs": 16, "mbs": 4, "extra_iters": 1},
)
TOTAL_SAMPLES = 3 * 8 + 3 * 16 + 1 * 16


def killing_launcher(launch: StageLaunch) -> None:
    """Stages run :mod:`kill_in_save_worker`, which kills the process group in stage 2's final save."""
    python_path = [str(WORKERS), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, KILL_STAGE_ENV: "2", "PYTHONPATH": os.pathsep.join(python_path)}
    run_stage(
        launch.spec_path,
        launch.spec.stage_dir,
        launch.topology,
        device_type=launch.device_type,
        quiet=True,
        worker_module="kill_in_save_worker",
        env=env,
    )


@pytest.mark.slow
@pytest.mark.multiproc
def test_sigkill_during_the_save_for_a_switch_resumes_without_skipping_or_repeating_samples(
    tmp_path, monkeypatch, tiny_config_file
):
    for name, value in TRACE_ENV.items():  # the workers record what they train on
        monkeypatch.setenv(name, value)
    config = tiny_config_file(data="markov")
    chain = write_chain(tmp_path / "chain.json", list(STEPS))
    args = chain_args(config, chain, tmp_path, "kill", stages=len(STEPS))
    wait_status = killed_in_own_process_group(
        lambda: run_chain(train_runs.chain_run(args), launcher=killing_launcher, out=lambda line: None)
    )
    assert os.WIFSIGNALED(wait_status) and os.WTERMSIG(wait_status) == signal.SIGKILL, wait_status

    run_dir = tmp_path / "logs" / "kill"
    state = load_state(run_dir)
    assert [stage.status for stage in state.stages] == ["done", "running", "pending"]
    stage1_universal = Path(state.stages[0].universal)
    stage2_layout = tmp_path / "checkpoints" / "kill" / "gpt-tiny" / "z1" / "fp32" / "tp2_pp1_dp1_sp1"
    leftovers = sorted(path.name for path in stage2_layout.iterdir())
    assert len(leftovers) == 1 and leftovers[0].startswith(".tmp-global_step6-"), leftovers
    assert list((stage2_layout / leftovers[0]).glob("*.distcp"))  # the shards were written
    killed = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    killed_stage2 = [record for record in killed if record["stage"] == 2]
    assert [record["iteration"] for record in killed_stage2] == [4, 5, 6]
    killed_trace = {step.iteration: step.sample_ids for step in trained_steps(run_dir)}
    assert sorted(killed_trace) == list(range(1, 7))

    # The same command again (on fresh ports: the killed stage's may still be held by the kernel), its
    # stages 2 and 3 in one worker session as `cona train --chain` runs them.
    lines: list[str] = []
    args.master_port_base = free_port_base(len(STEPS))
    with WorkerSession() as session:
        state = run_chain(train_runs.chain_run(args), launcher=session, out=lines.append)

    assert lines[0] == (
        f"resuming run kill at stage 2 (running) from {stage1_universal}, iteration=3, "
        f"consumed_samples=24, consumed_tokens={24 * MARKOV_SEQ}"
    )
    spec = json.loads((run_dir / "stages" / "2" / "spec.json").read_text())
    assert spec["load_path"] == str(stage1_universal)
    assert [stage.status for stage in state.stages] == ["done"] * 3
    assert state.stages[-1].consumed_samples == TOTAL_SAMPLES
    assert not any(path.name.startswith(".tmp-") for path in stage2_layout.iterdir())

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    retrained = [record for record in records[len(killed) :] if record["stage"] == 2]
    assert [record["iteration"] for record in retrained] == [4, 5, 6]
    np.testing.assert_allclose(
        [record["loss"] for record in retrained], [record["loss"] for record in killed_stage2], rtol=1e-6
    )
    # The run's training as it stands: each iteration's last record (the rerun's for 4..6).
    final = {record["iteration"]: record for record in records}
    assert sorted(final) == list(range(1, 8))
    # What the workers trained, as it stands after the rerun: ids 0..87 in order, each once; and the
    # retrained iterations took the same samples as the killed attempt.
    trained = assert_each_sample_once_in_order(run_dir, total_samples=TOTAL_SAMPLES)
    assert all(step.sample_ids == killed_trace[step.iteration] for step in trained if step.iteration <= 6)
    assert [final[i]["consumed_samples"] for i in sorted(final)] == [8, 16, 24, 40, 56, 72, 88]
