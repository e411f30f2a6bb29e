"""A resumed online run remembers the probes its candidates lost, as the killed run did."""

from __future__ import annotations

import dataclasses
import json

from tests.planner.test_policy_probe import outcome

from cona.planner.policy import Candidate, initial_state
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
