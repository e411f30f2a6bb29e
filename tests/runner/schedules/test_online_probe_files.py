"""What the runner reads back from ``probes.jsonl``: the probes a resumed run's candidates lost, and the
switch a won probe made."""

from __future__ import annotations

import dataclasses
import json

from tests.helpers.policy_cases import outcome

from cona.planner.policy import Candidate, initial_state
from cona.runner.schedules.online import won_probe_switch
from cona.runner.schedules.online_memory import lost_probes
from cona.strategy import Strategy


def test_the_lost_probes_of_probes_jsonl_space_the_next_probe_after_a_resume(tmp_path):
    lost, won = outcome(4.3), dataclasses.replace(outcome(4.005), consumed_samples=3200)
    assert (lost.winner, won.winner) == ("current", "candidate")
    lines = [lost.to_dict(), {"stage": 2, "iteration": 9, "skipped": "too close to the end"}, won.to_dict()]
    (tmp_path / "probes.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    state = initial_state(
        Candidate(strategy=Strategy(dp=4, tp=1, pp=1, mbs=4, gbs=16), predicted_tokens_per_s=1.0)
    )
    remembered = lost_probes(tmp_path, state, seq=8)
    (probed,) = remembered.probed
    assert (probed.gbs, probed.consumed_tokens, probed.noise_scale) == (32, 1600 * 8, None)
    assert lost_probes(tmp_path / "elsewhere", state, seq=8) == state  # no file: nothing lost


def test_a_stage_that_ended_on_a_won_probe_records_the_candidate_whatever_the_request_file_says(tmp_path):
    current = Strategy(dp=4, tp=1, pp=1, mbs=4, gbs=16)
    won = outcome(4.005)  # began at iteration 100, gbs 16 -> 32 (mbs 8)
    (tmp_path / "probes.jsonl").write_text(json.dumps(outcome(4.3).to_dict()) + "\n")
    assert won_probe_switch(tmp_path, 1, 100, current) is None  # the stage's last probe was lost
    with open(tmp_path / "probes.jsonl", "a") as handle:
        handle.write(json.dumps(won.to_dict()) + "\n")
    switch = won_probe_switch(tmp_path, 1, 100, current)
    assert switch.action == "switch" and switch.in_place and switch.throughput_source == "probed"
    assert switch.strategy == dataclasses.replace(current, gbs=32, mbs=8)
    assert switch.predicted_tokens_per_s == won.tokens / won.candidate.steady_seconds
    assert switch.reason.startswith("probe of gbs 32: ")
    assert won_probe_switch(tmp_path, 1, 96, current) is None  # the stage ended elsewhere: not on it
    assert won_probe_switch(tmp_path, 2, 100, current) is None  # another stage's probe
