"""Run state on disk: atomic round trip, forward-only transitions, refusing another chain's run directory."""

from __future__ import annotations

import dataclasses
import json

import pytest

from cona.config import TrainingConfig
from cona.engine.spec import StageResult
from cona.errors import ChainError
from cona.planner.efficiency import NoiseScaleTracker
from cona.runner.noise_history import measured_noise_scale, noise_tracker
from cona.runner.state import (
    STATE_NAME,
    advance,
    check_same_run,
    durations,
    load_state,
    new_state,
    resume_line,
    save_state,
    switch_cost,
    trained,
)


def three_stages():
    return new_state(chain_path="c.json", chain_digest="abc", config_digest="def", world_size=4, num_stages=3)


def test_round_trip_is_atomic_and_exact(tmp_path):
    assert load_state(tmp_path) is None
    state = three_stages()
    stage = advance(state.stage(1), "running", start_iteration=0, target_iteration=5, planned_at=12.5)
    stage = advance(
        stage,
        "trained",
        checkpoint="/x/global_step5",
        consumed_samples=40,
        consumed_tokens=320,
        timings={"save_s": 0.5},
    )
    state = state.with_stage(
        advance(stage, "published", universal="/x/global_step5_universal", pruned=("/x/old_universal",))
    )
    save_state(tmp_path, state)
    assert [path.name for path in tmp_path.iterdir()] == [STATE_NAME]  # no temporary left behind
    assert load_state(tmp_path) == state


def test_progress_queries():
    state = three_stages()
    assert state.current.step_num == 1 and state.last_finished is None and state.last_published is None
    first = advance(advance(state.stage(1), "running"), "trained", universal=None, consumed_samples=8)
    state = state.with_stage(advance(first, "done"))
    state = state.with_stage(advance(state.stage(2), "running"))
    assert state.current.step_num == 2 and state.last_finished.step_num == 1
    state = state.with_stage(advance(state.stage(2), "published", universal="/u2"))
    assert state.last_published == "/u2" and state.last_finished.step_num == 2


def test_transitions_only_move_forward():
    stage = advance(three_stages().stage(1), "trained")
    with pytest.raises(AssertionError, match="from trained back to running"):
        advance(stage, "running")
    running = advance(three_stages().stage(2), "running")
    assert advance(running, "running", attempts=2).attempts == 2  # a relaunch stays running


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"chain_digest": "other"}, "a different chain (it ran c.json)"),
        ({"config_digest": "other"}, "a different .conaconfig"),
        ({"world_size": 8}, "8 processes, not 4"),
        ({"workdir": "/elsewhere"}, "was made for --workdir /elsewhere"),
    ],
)
def test_a_run_directory_of_another_chain_is_refused(tmp_path, change, expected):
    state = dataclasses.replace(three_stages(), **change)
    same = {"run_dir": tmp_path, "chain_digest": "abc", "config_digest": "def", "world_size": 4}
    with pytest.raises(ChainError) as info:
        check_same_run(state, **same, workdir=tmp_path)
    assert expected in str(info.value) and "--fresh" in str(info.value) and str(tmp_path) in str(info.value)
    check_same_run(three_stages(), **same, workdir=tmp_path)  # a state that recorded no workdir
    recorded = dataclasses.replace(three_stages(), workdir=str(tmp_path.resolve()))
    check_same_run(recorded, **same, workdir=tmp_path)


def test_unreadable_state_points_at_fresh(tmp_path):
    (tmp_path / STATE_NAME).write_text('{"version": 1, "chain')
    with pytest.raises(ChainError, match="unreadable run state.*--fresh"):
        load_state(tmp_path)
    (tmp_path / STATE_NAME).write_text('{"version": 99}')
    with pytest.raises(ChainError, match="another cona version"):
        load_state(tmp_path)


def test_switch_cost_combines_both_stages():
    previous = dataclasses.replace(
        three_stages().stage(1), timings={"save_s": 1.0, "publish_s": 0.25, "load_s": 9.0}
    )
    stage = dataclasses.replace(
        three_stages().stage(2), timings={"process_start_s": 2.0, "load_s": 0.5, "save_s": 7.0}
    )
    assert switch_cost(previous, stage) == {
        "save_s": 1.0,
        "publish_s": 0.25,
        "process_start_s": 2.0,
        "load_s": 0.5,
    }


def test_noise_scale_for_adascale_counts_each_iteration_once(tmp_path):
    """A retried stage logs iterations again: the retry's record replaces the first, never adds to it."""
    record = {"gns_small_sqr": 2.0, "gns_big_sqr": 1.2, "gns_small_batch": 2, "gns_big_batch": 8}
    retry = {**record, "gns_big_sqr": 1.1}
    lines = [json.dumps({"iteration": i, **record}) for i in range(1, 13)]
    lines += [json.dumps({"iteration": 5, **retry}), '{"iteration": 13, "gns']  # the last line: cut by a kill
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines))
    training = TrainingConfig(base_gbs=8)
    assert measured_noise_scale(tmp_path, training, up_to_iteration=6) is None  # fewer than 7 measurements
    expected = NoiseScaleTracker(base_batch=8)
    for iteration in range(1, 13):
        expected = expected.update_from_metrics(retry if iteration == 5 else record)
    estimate = measured_noise_scale(tmp_path, training, up_to_iteration=12)
    assert estimate == expected.estimate()
    assert noise_tracker(tmp_path, 8, up_to_iteration=12).samples == 12  # folded once each


def test_durations_split_out_the_switch_check():
    timings = {
        "process_start": 10.0,
        "load_done": 12.0,
        "verify_done": 12.5,
        "setup_done": 12.625,
        "first_step_done": 13.0,
        "train_done": 20.0,
        "probe_done": 20.25,
        "save_done": 21.0,
    }
    assert durations(timings, 9.0) == {
        "process_start_s": 1.0,
        "load_s": 2.0,
        "verify_s": 0.5,
        "first_step_s": 0.375,
        "probe_s": 0.25,
        "save_s": 0.75,
    }
    # A worker that loaded and saved without a probe (older results): the spans join up as before.
    unprobed = {k: v for k, v in timings.items() if k not in ("load_done", "verify_done", "probe_done")}
    assert durations(unprobed, None) == {"load_s": 2.625, "first_step_s": 0.375, "save_s": 1.0}


def test_a_relaunched_stage_charges_its_switch_the_start_of_its_first_attempt_not_the_resume():
    """Stopped after its first steps and relaunched by a rerun, the stage's start parts are the first
    attempt's: the rerun's process start and its load of the stage's own periodic checkpoint are downtime."""
    first = {"launch": 100.0, "process_start": 101.0, "load_done": 103.0, "verify_done": 103.5}
    first |= {"setup_done": 103.75, "first_step_done": 104.0}
    resumed = {"launch": 900.0, "process_start": 928.0, "load_done": 933.0, "setup_done": 933.25}
    resumed |= {"first_step_done": 934.0, "train_done": 950.0, "probe_done": 950.5, "save_done": 952.0}
    result = StageResult(
        stage=2, reason="completed", last_iteration=8, consumed_samples=64, consumed_tokens=1024,
        checkpoint="/x/global_step8", timings=resumed,
    )  # fmt: skip
    stage = advance(three_stages().stage(2), "running")
    assert trained(stage, result, 900.0, first).timings == {
        "process_start_s": 1.0,
        "load_s": 2.0,
        "verify_s": 0.5,
        "first_step_s": 0.25,
        "probe_s": 0.5,  # the stage's own end: what the next switch costs
        "save_s": 1.5,
    }
    uninterrupted = dataclasses.replace(result, timings=first | {"train_done": 110.0, "save_done": 111.0})
    assert trained(stage, uninterrupted, 99.5, first).timings["process_start_s"] == 1.5  # the runner's launch


def test_switch_cost_counts_the_probe_before_the_save_and_the_check_after_the_load():
    previous = dataclasses.replace(
        three_stages().stage(1), timings={"probe_s": 0.1, "save_s": 1.0, "verify_s": 5.0}
    )
    stage = dataclasses.replace(
        three_stages().stage(2), timings={"load_s": 0.5, "verify_s": 0.2, "probe_s": 3.0}
    )
    cost = switch_cost(previous, stage)
    assert cost == {"probe_s": 0.1, "save_s": 1.0, "load_s": 0.5, "verify_s": 0.2}
    assert list(cost) == ["probe_s", "save_s", "load_s", "verify_s"]  # the order they happen in


def test_resuming_from_another_backends_checkpoint_takes_the_counters_of_the_run_state(tmp_path):
    megatron_checkpoint = tmp_path / "global_step5"  # a Megatron-DeepSpeed save: no CONA trainer_state.json
    megatron_checkpoint.mkdir()
    state = three_stages()
    first = advance(advance(state.stage(1), "running"), "trained", checkpoint=str(megatron_checkpoint))
    first = dataclasses.replace(first, last_iteration=5, consumed_samples=40, consumed_tokens=320)
    state = state.with_stage(advance(first, "done"))
    line = resume_line(state, "run", [(tmp_path / "layout",)] * 3)
    assert line == (
        f"resuming run run at stage 2 (pending) from {megatron_checkpoint}, iteration=5, "
        "consumed_samples=40, consumed_tokens=320"
    )
