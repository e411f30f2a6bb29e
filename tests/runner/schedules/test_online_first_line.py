"""The first decision's rates come from the first line's steps after its first.

Before any steady line the run's rate is a prediction. Where the first line's steps after the stage's first
one ran the strategy's own step (they measured the noise scale without cutting the micro-batch), they show
this host's speed. A fake GPU host-bound at ``HOST_SLOWDOWN`` times the profile's dispatch (every strategy
of the tiny model is host-bound on the H200) feeds the search: fitted on that line, the predictions are the
fake's; the prior alone misses by the slowdown. Steps cut in pieces are no proxy (their shape warms up and
the noise hooks run: up to 4x a whole step's time).
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import pytest
from tests.helpers.chain_fakes import write_fake_chain_config

from cona.config.file import load_config
from cona.metrics_record import MetricsRecord
from cona.planner.efficiency import NoiseScaleTracker
from cona.planner.policy import Candidate, PolicySettings, initial_state
from cona.planner.systems import load_system
from cona.planner.throughput import Point, StepParts, ThroughputEstimator
from cona.runner.schedules.frontier import FrontierSearch
from cona.runner.schedules.online_search import Budget, StageSearch
from cona.strategy import Strategy, noise_step_pieces

HOST_SLOWDOWN = 1.6
FIRST_STEP_S = 2.0


def one_gpu(gbs: int, mbs: int) -> Strategy:
    return Strategy(dp=1, tp=1, pp=1, mbs=mbs, gbs=gbs)


@pytest.fixture
def frontier(tmp_path: Path) -> FrontierSearch:
    write_fake_chain_config(tmp_path)
    config = load_config(tmp_path / ".conaconfig")
    config = replace(config, training=config.training.replace(device="cuda", compile=False))
    h200 = load_system("h200_141g")
    return FrontierSearch(config=config, system=h200, n_gpus=1, dtype="bf16", botorch=False)


def fake_step_s(frontier: FrontierSearch, strategy: Strategy) -> float:
    """The fake GPU's step: the profile's host dispatch, slowed down (the device's work is far below it)."""
    parts = frontier.model_step(strategy)
    assert parts.host_s[0] > 10 * parts.device_s[0]  # host-bound, as the fake assumes
    return HOST_SLOWDOWN * float(parts.host_s[0])


def first_line(frontier: FrontierSearch, strategy: Strategy, *, steps: int = 8, measured: int = 7) -> dict:
    """The run's first line: the first step, then ``measured`` noise-measured steps and the rest (all at
    the fake's step of the strategy: the tests that cut steps in pieces look only at what is fitted)."""
    seq = frontier.config.model.seq
    step_time_s = (FIRST_STEP_S + (steps - 1) * fake_step_s(frontier, strategy)) / steps
    return {
        "stage": 1, "iteration": steps, "consumed_samples": steps * strategy.gbs, "gbs": strategy.gbs,
        "consumed_tokens": steps * strategy.gbs * seq, "mbs": strategy.mbs, "dp": 1, "tp": 1, "pp": 1,
        "step_time_s": step_time_s, "tokens_per_s": strategy.gbs * seq / step_time_s,
        "steps_in_interval": steps, "first_step_s": FIRST_STEP_S, "gns_small_sqr": 2.0, "gns_big_sqr": 1.2,
        "gns_small_batch": strategy.mbs // 2, "gns_big_batch": strategy.gbs,
        "gns_steps": [[2.0, 1.2]] * measured, "warmup_steps": 1, "time": time.time(),
    }  # fmt: skip


def search_at_first_line(run_dir: Path, frontier: FrontierSearch, line: dict) -> tuple[StageSearch, dict]:
    current = Strategy(**{key: line[key] for key in ("dp", "tp", "pp", "mbs", "gbs")})
    settings = PolicySettings(base_gbs=2, max_gbs=16, in_place=True, predicted_in_place_cost_s=0.0)
    state = initial_state(Candidate(strategy=current, predicted_tokens_per_s=1.0))
    search = StageSearch(
        run_dir=run_dir, stage=1, launched_at=time.time(), settings=settings, policy_state=state,
        tracker=NoiseScaleTracker(base_batch=2), frontier=frontier, startup_prices_switch=False,
        budget=Budget(total_iters=10**9, total_tokens=None, target_ppl=None, seq=frontier.config.model.seq),
        out=lambda text: None,
    )  # fmt: skip
    (run_dir / "metrics.jsonl").write_text(json.dumps(line) + "\n")
    search.poll()
    search.stop()
    return search, json.loads((run_dir / "decisions.jsonl").read_text().splitlines()[-1])


def test_the_first_lines_steps_give_the_hosts_speed_to_every_prediction(tmp_path, frontier):
    current, larger = one_gpu(8, 4), one_gpu(16, 8)  # two micro-batches: the noise needs no pieces
    assert noise_step_pieces(current) == 1
    seq = frontier.config.model.seq
    truth = {s: s.gbs * seq / fake_step_s(frontier, s) for s in (current, larger)}
    prior = {s: frontier.predicted_tokens_per_s(s) for s in truth}
    assert all(prior[s] / truth[s] == pytest.approx(HOST_SLOWDOWN) for s in truth)  # the prior misses

    _, record = search_at_first_line(tmp_path, frontier, first_line(frontier, current))
    assert record["current"]["rate_measured"] is False
    assert record["current"]["measured_tokens_per_s"] == pytest.approx(truth[current], rel=0.02)
    assert record["throughput_fit"]["proxy_points"] == ["stage 1 first line"]
    assert record["candidate"]["on_first_line"] and record["candidate"]["fitted_on"] == 0
    assert frontier.predicted_tokens_per_s(larger) == pytest.approx(truth[larger], rel=0.02)
    # A proxy is no measurement: the decision stays a trial's, and nothing reads as measured.
    assert frontier.estimator.measured_tokens_per_s(current) is None


@pytest.mark.parametrize(
    "change",
    [
        {"mbs": 8},  # one micro-batch: the measured steps ran in pieces
        {"first_step_s": None},  # a line from before first_step_s
        {"warmup_steps": 2},  # a step after the first still warmed up a shape
    ],
)
def test_a_first_line_that_shows_no_steady_step_gives_no_point(tmp_path, frontier, change):
    line = first_line(frontier, one_gpu(8, 4)) | change
    _, record = search_at_first_line(tmp_path, frontier, line)
    assert not frontier.estimator.points and "proxy_points" not in record["throughput_fit"]


def test_a_proxy_leaves_the_fit_once_a_strategy_is_measured_itself():
    def point(strategy: Strategy, seconds: float, *, proxy: bool) -> Point:
        parts = StepParts.of(host_s=0.03, matrix_s=0.001, micro_batches=strategy.micro_batches)
        return Point(strategy=strategy, tokens_per_s=strategy.gbs / seconds, model=parts, proxy=proxy)

    estimator = ThroughputEstimator(seq=1).with_point(point(one_gpu(8, 4), 0.06, proxy=True))
    assert estimator.points and not estimator.has_own_measurement
    assert estimator.estimate(one_gpu(8, 4), StepParts.of(host_s=0.03)).source == "predicted"
    estimator = estimator.with_point(point(one_gpu(8, 8), 0.04, proxy=False))
    assert [p.proxy for p in estimator.points] == [False] and estimator.has_own_measurement
    assert estimator.measured_tokens_per_s(one_gpu(8, 8)) == pytest.approx(200.0)


def test_the_first_lines_other_steps_time():
    record = MetricsRecord(step_time_s=0.5, steps_in_interval=8, first_step_s=1.5)
    assert record.after_first_step_s == pytest.approx((4.0 - 1.5) / 7)
    assert MetricsRecord(step_time_s=0.5, steps_in_interval=8).after_first_step_s is None
    assert MetricsRecord(step_time_s=0.5, steps_in_interval=1, first_step_s=0.5).after_first_step_s is None
    assert MetricsRecord(gns_steps=[[1.0, 2.0]] * 3).measured_steps == 3
    assert MetricsRecord(gns_small_sqr=1.0).measured_steps == 1 and MetricsRecord().measured_steps == 0
