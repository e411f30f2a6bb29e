"""A CPU run's prior fitted on the model's steps timed on this host before its first stage is chosen, so the
first choice and its predicted rate rest on this machine's speed, not only on the system file's."""

from __future__ import annotations

import json

import pytest
from tests.helpers.chain_fakes import FAKE_MODEL
from tests.helpers.online_fakes import StreamingEngine, tiny_online_run
from tests.helpers.tiny import tiny_config

from cona.engine.host_steps import HostStep, time_host_steps
from cona.planner.systems import load_system
from cona.runner.schedules.frontier import FrontierSearch
from cona.runner.schedules.online import run_online
from cona.strategy import Strategy

CONFIG = tiny_config(model=FAKE_MODEL)


def one_process(mbs: int) -> Strategy:
    return Strategy(dp=1, tp=1, pp=1, mbs=mbs, gbs=mbs, zero_stage=1)


def frontier(n_gpus: int = 2) -> FrontierSearch:
    return FrontierSearch(
        config=CONFIG, system=load_system("cpu_gloo"), n_gpus=n_gpus, dtype="fp32", botorch=False
    )


def test_the_prior_fitted_on_two_timed_steps_predicts_them_at_the_workers_share_of_the_host():
    seq = CONFIG.model.seq
    steps = [HostStep(micro_batch=1, seconds=0.040), HostStep(micro_batch=2, seconds=0.060)]
    alone = frontier()
    raw = {mbs: alone.predicted_tokens_per_s(one_process(mbs)) for mbs in (1, 2)}
    line = alone.fit_prior(steps, world_size=2, cores=2, threads=1)
    assert line.startswith(
        "prior fitted to this host: the model's step timed at mbs 1 40.0 ms, mbs 2 60.0 ms"
    )
    fitted = {mbs: alone.predicted_tokens_per_s(one_process(mbs)) for mbs in (1, 2)}
    assert fitted == pytest.approx({1: seq / 0.040, 2: 2 * seq / 0.060}, rel=0.05)
    assert raw[2] / fitted[2] > 10  # the system file's prior: a core of another speed, no per-step overhead
    assert not alone.estimator.points  # a prior, not a measurement: the run's own points replace it

    shared = frontier(n_gpus=4)  # 4 workers on 2 cores: each runs at half the speed of one alone
    shared.fit_prior(steps, world_size=4, cores=2, threads=1)
    assert shared.predicted_tokens_per_s(one_process(2)) == pytest.approx(fitted[2] / 2, rel=0.05)


def test_the_model_s_step_is_timed_at_each_micro_batch_size():
    steps = time_host_steps(CONFIG.model, (1, 2), threads=1)
    assert [step.micro_batch for step in steps] == [1, 2] and all(step.seconds > 0 for step in steps)


def test_a_slow_model_is_timed_at_one_size_in_two_steps(monkeypatch):
    calls = []
    monkeypatch.setattr("cona.engine.host_steps._step", lambda net, optimizer, tokens: calls.append(1) or 2.0)
    assert time_host_steps(CONFIG.model, (1, 2), threads=1) == [HostStep(micro_batch=1, seconds=2.0)]
    assert len(calls) == 2


def test_a_cpu_run_chooses_its_first_stage_on_the_prior_fitted_to_its_host(tmp_path, monkeypatch):
    timed = [HostStep(micro_batch=1, seconds=0.5), HostStep(micro_batch=2, seconds=0.75)]
    monkeypatch.setattr("cona.engine.host_steps.time_host_steps", lambda model, sizes, threads: timed)
    run = tiny_online_run(tmp_path, prior_on_host=True)
    lines: list[str] = []
    run_online(run, launcher=StreamingEngine(), out=lines.append)
    assert lines[0].startswith("prior fitted to this host: the model's step timed at mbs 1 500.0 ms")
    first = json.loads((run.run_dir / "online_stages.json").read_text())[0]
    # half a second a step for a micro-batch of 1: some tens of tokens/s, not the file's thousands
    assert first["action"] == "initial" and first["predicted_tokens_per_s"] < 100, first
