"""The online search's decision inputs when the device's throughput is not the model's.

A fake device with a host-bound floor (its step time is ``max(host, device)``, the model's is device only)
feeds ``metrics.jsonl``; the real :class:`FrontierSearch` and :class:`StageSearch` read it. The throughput the
decision expects of the candidate, on a device of a form the fitter does not know, must be the device's
within 10%: dropping the correction (the raw model) or inverting it misses by far more, and so would one
factor anchored on the running strategy.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
from tests.helpers.chain_fakes import write_fake_chain_config
from tests.helpers.online_fakes import append, decisions, make_search, metrics_record

from cona.config.file import load_config
from cona.planner.efficiency import NoiseScaleTracker
from cona.planner.policy import Candidate, PolicySettings, after_switch, initial_state
from cona.planner.systems import load_system
from cona.planner.throughput import host_micro_batches, model_step_seconds
from cona.runner.schedules.frontier import FrontierSearch
from cona.runner.schedules.online_search import Budget, StageSearch
from cona.strategy import Strategy
from cona.switch_request import SwitchRequest

SEQ = 8  # the tiny config's


class HostBoundDevice:
    """Step seconds ``max(host_step + host_micro_batch x micro-batches, model / 0.8)``, with the host floor
    set at 4x the model's step at gbs 2: small batches cost the same time, as on a GPU dispatching eagerly."""

    def __init__(self, config, system) -> None:
        self.config, self.system = config, system
        base = float(model_step_seconds(config.model, [one_gpu(2, 2)], system, "fp32")[0])
        self.host_step_s, self.host_micro_batch_s = 0.5 * base, 3.5 * base

    def model_tokens_per_s(self, strategy: Strategy) -> float:
        model_s = float(model_step_seconds(self.config.model, [strategy], self.system, "fp32")[0])
        return strategy.gbs * SEQ / model_s

    def tokens_per_s(self, strategy: Strategy) -> float:
        model_s = float(model_step_seconds(self.config.model, [strategy], self.system, "fp32")[0])
        host = self.host_step_s + self.host_micro_batch_s * host_micro_batches(strategy)
        return strategy.gbs * SEQ / max(host, model_s / 0.8)


class UnlikeTheFitDevice(HostBoundDevice):
    """A device of no form the fitter knows: host time grows as micro-batches ** 0.85, the kernels' efficiency
    grows with mbs (0.6 + 0.05 mbs), and host and device overlap imperfectly (a soft maximum, the 4-norm of
    the two), so the fitted prediction is near the truth, not equal to it."""

    def tokens_per_s(self, strategy: Strategy) -> float:
        model_s = float(model_step_seconds(self.config.model, [strategy], self.system, "fp32")[0])
        host = self.host_step_s + self.host_micro_batch_s * host_micro_batches(strategy) ** 0.85
        device = model_s / (0.6 + 0.05 * strategy.mbs)
        return strategy.gbs * SEQ / (host**4 + device**4) ** 0.25


def one_gpu(gbs: int, mbs: int) -> Strategy:
    return Strategy(dp=1, tp=1, pp=1, mbs=mbs, gbs=gbs)


def metrics(stage: int, strategy: Strategy, tokens_per_s: float, iterations: range) -> list[dict]:
    """Log lines of ``stage`` at a planted noise scale of 1000 (|G|^2 = 1) and the device's throughput."""
    gbs, trace = strategy.gbs, 1000.0
    return [
        {
            "stage": stage,
            "iteration": i,
            "consumed_samples": i * gbs,
            "consumed_tokens": i * gbs * SEQ,
            "gbs": gbs,
            "step_time_s": gbs * SEQ / tokens_per_s,
            "steps_in_interval": 1,
            "tokens_per_s": tokens_per_s,
            "gns_small_sqr": 1.0 + trace,
            "gns_big_sqr": 1.0 + trace / gbs,
            "gns_small_batch": 1,
            "gns_big_batch": gbs,
            "time": time.time(),
        }
        for i in iterations
    ]


@pytest.fixture
def setup(tmp_path: Path):
    write_fake_chain_config(tmp_path)
    config = load_config(tmp_path / ".conaconfig")
    system = load_system("cpu_gloo")
    frontier = FrontierSearch(config=config, system=system, n_gpus=1, dtype="fp32", botorch=False)
    return tmp_path, frontier, HostBoundDevice(config, system)


def run_stage(run_dir: Path, frontier, device, *, stage: int, current: Strategy, state=None) -> list[dict]:
    """One stage of the search on the device's metrics until its first decision with a candidate."""
    settings = PolicySettings(base_gbs=2, max_gbs=16, predicted_switch_cost_s=0.0, hysteresis=0.0)
    candidate = Candidate(strategy=current, predicted_tokens_per_s=frontier.predicted_tokens_per_s(current))
    search = StageSearch(
        run_dir=run_dir,
        stage=stage,
        launched_at=time.time(),
        settings=settings,
        policy_state=state or initial_state(candidate),
        tracker=NoiseScaleTracker(base_batch=2),
        frontier=frontier,
        budget=Budget(total_iters=10**9, total_tokens=None, target_ppl=None, seq=SEQ),
        startup_prices_switch=False,
        out=lambda line: None,
    )
    with open(run_dir / "metrics.jsonl", "a") as handle:
        for record in metrics(stage, current, device.tokens_per_s(current), range(1, 31)):
            handle.write(json.dumps(record) + "\n")
    search.poll()
    search.stop()
    logged = [json.loads(line) for line in (run_dir / "decisions.jsonl").read_text().splitlines()]
    return [d for d in logged if d["stage"] == stage]


def expected(record: dict) -> tuple[Strategy, float]:
    return Strategy(**record["candidate"]["strategy"]), record["candidate"]["predicted_tokens_per_s"]


def test_the_candidates_throughput_is_the_devices_not_the_models(setup):
    run_dir, frontier, host_bound = setup
    device = UnlikeTheFitDevice(host_bound.config, host_bound.system)
    # Stage 1 trained gbs 2 and gbs 2 with two micro-batches; the running stage trains gbs 4.
    for strategy in (one_gpu(2, 2), one_gpu(2, 1)):
        frontier.add_measurement(strategy, device.tokens_per_s(strategy), intervals=5, source="stage 1")
    current = one_gpu(4, 4)
    last = run_stage(run_dir, frontier, device, stage=2, current=current)[-1]
    assert last["current"]["measured_tokens_per_s"] == pytest.approx(device.tokens_per_s(current))
    strategy, predicted = expected(last)
    assert strategy.gbs == 8 and last["candidate"]["throughput_source"] == "predicted"
    truth = device.tokens_per_s(strategy)
    assert predicted == pytest.approx(truth, rel=0.1)  # 1.03 of it
    assert last["throughput_fit"]["measured_strategies"] == 3 and last["candidate"]["fitted_on"] == 3
    # What the planted bugs would have used instead: the raw model, its inverse correction, and the model
    # times measured / model of the running strategy (the old anchor) are all far off.
    model = device.model_tokens_per_s(strategy)
    anchor = device.tokens_per_s(current) / device.model_tokens_per_s(current)
    for wrong in (model, model * (predicted / model) ** -1, model * anchor):
        assert abs(wrong / truth - 1.0) > 0.3, (wrong, truth)


def test_a_strategy_the_run_trained_is_expected_at_its_measured_throughput(setup):
    """After a fall-back to gbs 2, the frontier's gbs 4 is what stage 2 measured, not a prediction."""
    run_dir, frontier, device = setup
    small, large = one_gpu(2, 2), one_gpu(4, 4)
    frontier.add_measurement(small, device.tokens_per_s(small), intervals=5, source="stage 1")
    frontier.add_measurement(large, 0.9 * device.tokens_per_s(large), intervals=5, source="stage 2")
    state = initial_state(Candidate(strategy=large, predicted_tokens_per_s=1.0))
    back = Candidate(
        strategy=small, predicted_tokens_per_s=device.tokens_per_s(small), throughput_source="measured"
    )
    state = after_switch(state, new=back, old_measured_tokens_per_s=1.0, switch_cost_s=0.0)
    last = run_stage(run_dir, frontier, device, stage=3, current=small, state=state)[-1]
    strategy, predicted = expected(last)
    assert strategy == large and last["candidate"]["throughput_source"] == "measured"
    assert predicted == pytest.approx(0.9 * device.tokens_per_s(large))
    assert np.isfinite(last["throughput_fit"]["error"])


def test_the_frontier_predicts_with_the_profile_of_the_backend_that_trains(tmp_path):
    """Online mode through Megatron-DeepSpeed: the frontier's model is that backend's profile (its step
    seconds, and the best strategy of a gbs ranked by them), not the native engine's."""
    write_fake_chain_config(tmp_path)
    config, system = load_config(tmp_path / ".conaconfig"), load_system("cpu_gloo")
    native = FrontierSearch(config=config, system=system, n_gpus=2, dtype="fp32", botorch=False)
    megatron = FrontierSearch(config=config, system=system, n_gpus=2, dtype="fp32", botorch=False,
                              backend="megatron-deepspeed")  # fmt: skip
    strategy = Strategy(dp=2, tp=1, pp=1, mbs=1, gbs=4)
    expected_s = model_step_seconds(config.model, [strategy], system, "fp32", backend="megatron-deepspeed")[0]
    assert megatron.model_step_s(strategy) == pytest.approx(float(expected_s))
    assert megatron.model_step_s(strategy) != pytest.approx(native.model_step_s(strategy))
    best = megatron(4)
    assert best is not None and best.predicted_tokens_per_s == pytest.approx(
        4 * config.model.seq / megatron.model_step_s(best.strategy)
    )


def first_stage_search(
    run_dir: Path, frontier, current: Strategy, *, earlier_stage=None, probe: bool = True
) -> StageSearch:
    settings = PolicySettings(
        base_gbs=2,
        max_gbs=16,
        in_place=True,
        predicted_in_place_cost_s=0.0,
        hysteresis=0.0,
        probe=probe,
        probe_tokens=SEQ,
    )
    state = initial_state(
        Candidate(strategy=current, predicted_tokens_per_s=frontier.predicted_tokens_per_s(current))
    )
    if earlier_stage is not None:
        state = after_switch(
            initial_state(earlier_stage),
            new=state.current,
            old_measured_tokens_per_s=earlier_stage.predicted_tokens_per_s,
            switch_cost_s=0.0,
            in_place=True,
            old_rate_measured=False,
        )
    return StageSearch(
        run_dir=run_dir, stage=2 if earlier_stage else 1, launched_at=time.time(), settings=settings,
        policy_state=state, tracker=NoiseScaleTracker(base_batch=2), frontier=frontier,
        budget=Budget(total_iters=10**9, total_tokens=None, target_ppl=None, seq=SEQ),
        startup_prices_switch=False, out=lambda line: None,
    )  # fmt: skip


def test_before_anything_is_measured_the_first_line_probes_and_never_switches_on_a_predicted_rate(setup):
    """The run's first line holds the start-up, so it gives no rate; with the noise scale known there (its
    steps are measured), the first decision uses the estimator's rate of the running strategy: a probe,
    which measures both rates itself, may be asked for; a switch on the prediction alone is not made."""
    run_dir, frontier, device = setup
    current = one_gpu(2, 2)
    for probe in (True, False):
        (run_dir / "decisions.jsonl").unlink(missing_ok=True)
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)
        search = first_stage_search(run_dir, frontier, current, probe=probe)
        first = metrics(1, current, device.tokens_per_s(current), range(1, 2))[0]
        first["gns_steps"] = [[first["gns_small_sqr"], first["gns_big_sqr"]]] * 7  # the first line's 7
        append_lines(run_dir, [first])
        decision = search.poll()
        record = json.loads((run_dir / "decisions.jsonl").read_text().splitlines()[-1])
        assert record["current"]["rate_measured"] is False and record["predicted_over_measured"] is None
        expected_rate = frontier.predicted_tokens_per_s(current)
        assert record["current"]["measured_tokens_per_s"] == pytest.approx(expected_rate)
        if probe:
            assert decision.action == "probe" and record["in_place"]
            request = SwitchRequest.read(run_dir / "switch_request.json")
            assert request.action == "probe" and request.strategy == decision.target.strategy
            assert request.probe.samples == 1 and request.probe.lr_factor == 1.0
        else:
            assert decision.action == "stay" and "only predicted" in decision.reason
        outcome = search.stop()
        assert outcome.rate_measured is False and not frontier.estimator.points  # a prediction is no point
        (run_dir / "switch_request.json").unlink(missing_ok=True)


def test_the_short_line_a_probe_forces_after_the_decision_is_no_rate_of_the_stage(setup):
    """A probe decided at the first line cuts the stage's next line short; that line ran no measured
    step (eager, such a line can run at 1.6x the stage's later rate) and leaves the stage unmeasured."""
    run_dir, frontier, device = setup
    current = one_gpu(2, 2)
    search = first_stage_search(run_dir, frontier, current)
    first, short = metrics(1, current, device.tokens_per_s(current), range(8, 17, 8))
    first.update(steps_in_interval=8, gns_steps=[[first["gns_small_sqr"], first["gns_big_sqr"]]] * 7)
    append_lines(run_dir, [first])
    assert search.poll().action == "probe"
    short.update(steps_in_interval=2, tokens_per_s=1.6 * short["tokens_per_s"])
    append_lines(run_dir, [short])
    outcome = search.stop()
    assert outcome.rate_measured is False and not frontier.estimator.points


def test_a_stage_left_unmeasured_takes_the_refitted_prediction_once_the_next_one_is_measured(setup):
    """The fall-back target's rate is the estimator's until that strategy is measured itself: once the
    current stage's rate joins the fit, the earlier stage's rate is the refitted prediction, not the raw
    model's."""
    run_dir, frontier, device = setup
    small, large = one_gpu(2, 2), one_gpu(4, 4)
    raw = Candidate(strategy=small, predicted_tokens_per_s=frontier.predicted_tokens_per_s(small))
    search = first_stage_search(run_dir, frontier, large, earlier_stage=raw)
    assert search.policy_state.earlier[0].rate_measured is False
    append_lines(run_dir, metrics(2, large, device.tokens_per_s(large), range(1, 4)))
    search.poll()
    earlier = search.policy_state.earlier[0]
    assert frontier.estimator.points and earlier.rate_measured is False
    assert earlier.measured_tokens_per_s == pytest.approx(frontier.predicted_tokens_per_s(small))
    assert earlier.measured_tokens_per_s != pytest.approx(raw.predicted_tokens_per_s, rel=0.05)


def append_lines(run_dir: Path, records: list[dict]) -> None:
    with open(run_dir / "metrics.jsonl", "a") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")


def test_the_search_measures_a_stage_after_a_warm_up_that_outlasts_its_first_line(tmp_path):
    """Compiled, a new shape can run slow for more than the stage's first line: that line and the warm-up
    after it stay out of the measured rate (and out of the stage summary's)."""
    search = make_search(tmp_path, predicted=1e9)
    rates = [100.0, 300.0, 1000.0, 1100.0]
    for iteration, rate in enumerate(rates, start=1):
        append(tmp_path, [metrics_record(iteration, 2, noise_scale=1.0, tokens_per_s=rate)])
        search.poll()
    assert search.measured_tokens_per_s() == pytest.approx(1050.0)  # the median of 1000 and 1100
    measured = [d["current"]["measured_tokens_per_s"] for d in decisions(tmp_path)]
    assert measured == [None, 300.0, 1000.0, 1050.0]


def test_the_search_takes_no_rate_from_a_line_that_warmed_up_a_shape(tmp_path):
    """Under CUDA graphs a run's second line records the whole micro-batch's graph (its first line measured
    the noise on pieces): the trainer flags it, and the search waits for the next line."""
    search = make_search(tmp_path, predicted=1e9)
    lines = [(100.0, 8), (300.0, 1), (1000.0, None)]
    for iteration, (rate, warmup) in enumerate(lines, start=1):
        extra = {"warmup_steps": warmup} if warmup else {}
        append(tmp_path, [metrics_record(iteration, 2, noise_scale=1.0, tokens_per_s=rate, **extra)])
        search.poll()
        if iteration == 2:
            assert search.measured_tokens_per_s() is None
    assert search.measured_tokens_per_s() == pytest.approx(1000.0)
    measured = [d["current"]["measured_tokens_per_s"] for d in decisions(tmp_path)]
    assert measured == [None, None, 1000.0]
