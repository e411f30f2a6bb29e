"""A chain's initial step may load a given checkpoint (``load_checkpoint``): another run's, continued at its
iteration and samples (the tiny GPT on 2 CPU processes, torchrun, gloo)."""

from __future__ import annotations

import numpy as np
import pytest
from tests.helpers.observed import TRACE_ENV, trained_steps
from tests.helpers.tiny import MARKOV_SEQ as MARKOV_SEQ
from tests.helpers.tiny_runs import chain_args, final_records, write_chain

from cona.commands import train_runs
from cona.runner.schedules.chain_schedule import run_chain
from cona.runner.worker_session import WorkerSession


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_chain_whose_first_step_loads_another_run_s_checkpoint_continues_that_run(
    tmp_path, monkeypatch, tiny_config_file
):
    """``load_checkpoint`` on the initial step: a second run continues the first one's checkpoint at its
    iteration and samples, under another layout, and trains what one chain of both steps trains (with the
    LR horizon fixed, so the first run alone had the same schedule)."""
    for name, value in TRACE_ENV.items():
        monkeypatch.setenv(name, value)
    config = tiny_config_file(data="markov", training={"lr_decay_tokens": 6 * 8 * MARKOV_SEQ})
    first = {"dp": 2, "tp": 1, "pp": 1, "gbs": 8, "mbs": 4, "train_iters": 3, "is_initial": True}
    then = {"dp": 1, "tp": 2, "pp": 1, "gbs": 8, "mbs": 4, "extra_iters": 3}
    both = write_chain(tmp_path / "both.json", [{**first, "convert": True}, then])
    with WorkerSession() as session:  # both steps in one process start (as `cona train --chain` runs it)
        run_chain(train_runs.chain_run(chain_args(config, both, tmp_path / "both", "both", stages=2)),
                  launcher=session, out=lambda line: None)  # fmt: skip
    alone = write_chain(tmp_path / "first.json", [first])
    run_chain(train_runs.chain_run(chain_args(config, alone, tmp_path / "a", "a", stages=1)),
              out=lambda line: None)  # fmt: skip
    given = (
        tmp_path / "a" / "checkpoints" / "a" / "gpt-tiny" / "z1" / "fp32" / "tp1_pp1_dp2_sp1" / "global_step3"
    )
    rest = {**then, "is_initial": True, "load_checkpoint": str(given)}
    continued = write_chain(tmp_path / "continued.json", [rest])
    lines: list[str] = []
    args = chain_args(config, continued, tmp_path / "b", "b", stages=1)
    state = run_chain(train_runs.chain_run(args), out=lines.append)
    assert any("iterations 3->6" in line and f"load {given}" in line for line in lines), lines
    assert state.stages[0].consumed_samples == 48 and state.stages[0].switch_check is not None
    steps, reference = trained_steps(tmp_path / "logs" / "b"), trained_steps(tmp_path / "logs" / "both")
    assert [step.iteration for step in steps] == [4, 5, 6]
    assert [step.sample_ids for step in steps] == [step.sample_ids for step in reference[3:]]
    losses, expected = final_records(tmp_path / "logs" / "b"), final_records(tmp_path / "logs" / "both")
    continued_losses = [losses[i]["loss"] for i in (4, 5, 6)]
    np.testing.assert_allclose(continued_losses, [expected[i]["loss"] for i in (4, 5, 6)], rtol=1e-6)
