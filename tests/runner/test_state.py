"""Run state on disk: atomic round trip, forward-only transitions, refusing another chain's run directory."""

from __future__ import annotations

import dataclasses
import json

import pytest

from cona.config import TrainingConfig
from cona.errors import ChainError
from cona.planner.efficiency import NoiseScaleTracker
from cona.runner.state import (
    STATE_NAME,
    advance,
    check_same_run,
    load_state,
    measured_noise_scale,
    new_state,
    save_state,
    switch_cost,
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
    ],
)
def test_a_run_directory_of_another_chain_is_refused(tmp_path, change, expected):
    state = dataclasses.replace(three_stages(), **change)
    with pytest.raises(ChainError) as info:
        check_same_run(state, run_dir=tmp_path, chain_digest="abc", config_digest="def", world_size=4)
    assert expected in str(info.value) and "--fresh" in str(info.value) and str(tmp_path) in str(info.value)
    check_same_run(three_stages(), run_dir=tmp_path, chain_digest="abc", config_digest="def", world_size=4)


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
    assert measured_noise_scale(tmp_path, training, up_to_iteration=9) is None  # fewer than 10 measurements
    expected = NoiseScaleTracker(base_batch=8)
    for iteration in range(1, 13):
        expected = expected.update_from_metrics(retry if iteration == 5 else record)
    estimate = measured_noise_scale(tmp_path, training, up_to_iteration=12)
    assert estimate == expected.estimate() and estimate.samples == 12
