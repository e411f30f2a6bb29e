"""A fake streaming engine and synthetic metrics for the online runner's tests: metrics lines whose
two-batch inputs give a chosen noise scale, a search over two strategies of the tiny fake-chain config, and
an online run of that config on 4 CPU workers."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from tests.helpers.chain_fakes import FakeEngine, write_fake_chain_config

from cona.config.file import load_config
from cona.engine.checkpoint.info import read_checkpoint_info
from cona.engine.checkpoint.paths import layout_dir
from cona.engine.spec import StageResult
from cona.planner.efficiency import NoiseScaleTracker
from cona.planner.policy import Candidate, PolicySettings, initial_state
from cona.runner.schedules.chain_schedule import StageLaunch
from cona.runner.schedules.online import OnlineRun
from cona.runner.schedules.online_search import Budget, StageSearch
from cona.strategy import Strategy

SEQ = 8
SMALL = Strategy(dp=2, tp=2, pp=1, mbs=1, gbs=2)
LARGE = Strategy(dp=4, tp=1, pp=1, mbs=1, gbs=4)


def metrics_record(iteration: int, gbs: int, *, noise_scale: float, grad_sqr: float = 1.0, **extra) -> dict:
    """A metrics line whose two-batch inputs give exactly ``noise_scale`` (|G|^2 = ``grad_sqr``)."""
    trace = noise_scale * grad_sqr
    return {
        "stage": 1,
        "iteration": iteration,
        "consumed_samples": iteration * gbs,
        "consumed_tokens": iteration * gbs * SEQ,
        "gbs": gbs,
        "step_time_s": 0.1,
        "steps_in_interval": 1,
        "tokens_per_s": 1000.0,
        "gns_small_sqr": grad_sqr + trace / 1,
        "gns_big_sqr": grad_sqr + trace / gbs,
        "gns_small_batch": 1,
        "gns_big_batch": gbs,
        "time": time.time(),
        **extra,
    }


def make_search(run_dir: Path, *, predicted: float, cost_s: float = 1.0, target_ppl=None) -> StageSearch:
    settings = PolicySettings(base_gbs=2, max_gbs=8, predicted_switch_cost_s=cost_s, hysteresis=0.0)
    frontier = {4: Candidate(strategy=LARGE, predicted_tokens_per_s=predicted)}
    return StageSearch(
        run_dir=run_dir,
        stage=1,
        launched_at=time.time(),
        settings=settings,
        policy_state=initial_state(Candidate(strategy=SMALL, predicted_tokens_per_s=1000.0)),
        tracker=NoiseScaleTracker(base_batch=2),
        frontier=frontier.get,
        budget=Budget(total_iters=100_000, total_tokens=None, target_ppl=target_ppl, seq=SEQ),
        out=lambda line: None,
    )


def append(run_dir: Path, records: list[dict]) -> None:
    with open(run_dir / "metrics.jsonl", "a") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")


def decisions(run_dir: Path) -> list[dict]:
    path = run_dir / "decisions.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


STEP_S = 0.02
"""A step of stage 1: the search thread (polling every 0.05 s) sees a few lines a poll and decides within
the stage's first lines (it switched at iteration 8 of 150)."""
LATER_STEP_S = 0.005
"""A step of a later stage (after the switch, at the largest gbs): the search still polls it over a dozen
times (the tests need it to go on there), without waiting out ~140 steps at stage 1's pace."""


class StreamingEngine:
    """A launcher that appends a metrics line per step (noise scale 1000, throughput growing with gbs) and
    honours switch_request.json at step boundaries as the worker does; checkpoints via FakeEngine."""

    def __init__(self, *, late_request: bool = False) -> None:
        self.launches: list[StageLaunch] = []
        self.late_request = late_request
        """Complete every stage, and only then find a switch request (the search decided too late)."""

    def __call__(self, launch: StageLaunch) -> None:
        self.launches.append(launch)
        spec = launch.spec
        state = read_checkpoint_info(spec.load_path).trainer_state if spec.load_path else {}
        iteration, tokens = state.get("iteration", 0), state.get("consumed_tokens", 0)
        samples, gbs = state.get("consumed_samples", 0), spec.strategy.gbs
        started, reason = time.time(), "completed"
        while iteration < spec.target_iteration:
            iteration, samples, tokens = iteration + 1, samples + gbs, tokens + gbs * SEQ
            record = metrics_record(iteration, gbs, noise_scale=1000.0, tokens_per_s=50.0 * gbs)
            append(spec.run_dir, [{**record, "stage": spec.stage, "consumed_samples": samples,
                                   "consumed_tokens": tokens}])  # fmt: skip
            time.sleep(STEP_S if spec.stage == 1 else LATER_STEP_S)
            if spec.switch_request_path.exists() and not self.late_request:
                reason = "switch_requested"
                break
        if self.late_request:
            request = {"action": "switch", "in_place": False, "strategy": dataclasses.asdict(LARGE),
                       "predicted_tokens_per_s": 1.0, "reason": "late"}  # fmt: skip
            spec.switch_request_path.write_text(json.dumps(request))
        target_dir = layout_dir(spec.workdir, spec.config, spec.strategy, "fp32", run_name=spec.run_name)
        checkpoint = FakeEngine._save(spec, target_dir, iteration, samples, tokens)
        now = time.time()
        timings = {"launch": started, "process_start": started, "setup_done": started,
                   "first_step_done": started, "train_done": now, "save_done": now}  # fmt: skip
        StageResult(
            stage=spec.stage,
            reason=reason,
            last_iteration=iteration,
            consumed_samples=samples,
            consumed_tokens=tokens,
            checkpoint=str(checkpoint),
            timings=timings,
        ).write(spec.result_path)


def tiny_online_run(tmp_path: Path, **overrides) -> OnlineRun:
    """An online run of the tiny config on 4 CPU workers, gbs 2 -> 4, 150 iterations, no hysteresis."""
    write_fake_chain_config(tmp_path)
    return OnlineRun(
        config=load_config(tmp_path / ".conaconfig"),
        workdir=tmp_path,
        run_dir=tmp_path / "logs" / "online",
        world_size=4,
        device_type="cpu",
        system="cpu_gloo",
        initial_gbs=2,
        max_gbs=4,
        total_iters=150,
        botorch=False,
        policy_overrides={"hysteresis": 0.0},
        **overrides,
    )
