"""An online stage resumed from a checkpoint it saved itself (a periodic one) starts its search with the
noise-scale tracker of the metrics lines up to that checkpoint, as the uninterrupted stage had it then."""

from __future__ import annotations

import json
import types

import torch
from tests.helpers.chain_fakes import write_fake_chain_config

from cona.config.file import load_config
from cona.engine.checkpoint.save import save_checkpoint
from cona.planner.policy import Candidate, after_switch, initial_state
from cona.runner.noise_history import noise_tracker
from cona.runner.schedules.online_memory import resumed_memory, tracker_at_resume
from cona.runner.schedules.online_stages import StageRecords
from cona.runner.state import RunState, StageState
from cona.strategy import Strategy

RECORD = {"gns_small_sqr": 2.0, "gns_big_sqr": 1.2, "gns_small_batch": 2, "gns_big_batch": 8}


def checkpoint_of(tmp_path, config, *, stage: int, iteration: int):
    model = torch.nn.Linear(2, 2)
    return save_checkpoint(
        tmp_path / "layout",
        iteration=iteration,
        model_parts=[model],
        optimizer=torch.optim.AdamW(model.parameters()),
        trainer_state={"iteration": iteration, "consumed_samples": 8 * iteration, "stage": stage},
        config=config,
        strategy=Strategy(dp=1, tp=1, pp=1, mbs=1, gbs=8),
    )


def test_the_search_of_a_resumed_stage_counts_the_stage_s_lines_up_to_its_checkpoint(tmp_path):
    config = load_config(write_fake_chain_config(tmp_path))
    lines = [json.dumps({"iteration": i, **RECORD, "gns_big_sqr": 1.0 + i / 100}) for i in range(1, 15)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    run = types.SimpleNamespace(run_dir=tmp_path, config=config)
    at_stage_start = noise_tracker(tmp_path, config.training.lr.base_gbs, 4)  # stage 2 started at 4
    memory = types.SimpleNamespace(tracker=at_stage_start)

    own = checkpoint_of(tmp_path, config, stage=2, iteration=10)
    resumed = tracker_at_resume(run, memory, 2, own)
    assert resumed == noise_tracker(tmp_path, config.training.lr.base_gbs, 10) and resumed.samples == 10
    previous = checkpoint_of(tmp_path, config, stage=1, iteration=4)  # the stage's planned load
    assert tracker_at_resume(run, memory, 2, previous) is at_stage_start
    assert tracker_at_resume(run, memory, 2, None) is at_stage_start


def test_a_resumed_search_remembers_the_stages_the_uninterrupted_one_does(tmp_path):
    """8 -> 16 -> 32 -> fall-back to 16: the search in the killed run remembered stage 1 only (the fall-back
    dropped gbs 16, current again, and never kept gbs 32); the resumed one must not remember gbs 32 as a
    stage to fall back to."""
    config = load_config(write_fake_chain_config(tmp_path))
    sizes, rates = (8, 16, 32, 16), (1000.0, 1500.0, 1800.0)
    strategies = [Strategy(dp=1, tp=1, pp=1, mbs=gbs, gbs=gbs) for gbs in sizes]
    records = StageRecords(tmp_path)
    for number, strategy in enumerate(strategies):
        action = ("initial", "switch", "switch", "fallback")[number]
        records.add(Candidate(strategy=strategy, predicted_tokens_per_s=1000.0), action=action, reason="")
    lines = [
        {"iteration": i, "stage": 1 + (i - 1) // 4, "tokens_per_s": rates[(i - 1) // 4]} for i in range(1, 13)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    stages = tuple(
        StageState(
            step_num=n, status="done", start_iteration=4 * (n - 1), last_iteration=4 * n, consumed_tokens=n
        )
        for n in (1, 2, 3)
    ) + (StageState(step_num=4, status="running", start_iteration=12),)
    state = RunState(chain_path="", chain_digest="", config_digest="", world_size=1, stages=stages)
    run = types.SimpleNamespace(
        run_dir=tmp_path, config=config, max_gbs=32, policy_overrides={}, nodes=None, backend="native"
    )
    resumed = resumed_memory(run, state, records, in_place=True).policy_state.earlier

    uninterrupted = initial_state(records.candidate(1))
    for number in (2, 3, 4):
        uninterrupted = after_switch(
            uninterrupted,
            new=records.candidate(number),
            old_measured_tokens_per_s=rates[number - 2],
            switch_cost_s=None,
        )
    assert resumed == uninterrupted.earlier
    assert [stage.strategy.gbs for stage in resumed] == [8]
