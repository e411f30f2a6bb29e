"""``cona plan``'s replay runs the same policy with probes: the run's recorded outcomes, else the world's."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from cona.config import TrainingConfig
from cona.errors import PlanError
from cona.planner.efficiency import NoiseScaleEstimate
from cona.planner.plan import NoiseProfile, simulate
from cona.planner.policy import Candidate, PolicySettings
from cona.planner.probe_rule import BranchRun, ProbeOutcome
from cona.planner.trace import read_trace
from cona.strategy import Strategy

SMALL = Candidate(strategy=Strategy(dp=4, tp=1, pp=1, mbs=1, gbs=4), predicted_tokens_per_s=100.0)
LARGE = Candidate(strategy=Strategy(dp=4, tp=1, pp=1, mbs=2, gbs=8), predicted_tokens_per_s=180.0)
PROBING = PolicySettings(base_gbs=4, max_gbs=8, in_place=True, probe=True, probe_tokens=400)
SEQ = 8
PROBING_TRAINING = TrainingConfig(base_gbs=4)


def profile(noise_scale: float, segments: int = 20, progress: float = 1e6) -> NoiseProfile:
    estimate = NoiseScaleEstimate(grad_sqr=1.0, trace_sigma=noise_scale, samples=50)
    return NoiseProfile(edges=np.linspace(0, progress, segments + 1), estimates=(estimate,) * segments)


def lost_probe(at_tokens: int) -> ProbeOutcome:
    def branch(gbs: int, loss: float, seconds: float) -> BranchRun:
        return BranchRun(
            gbs=gbs, mbs=gbs // 4, lr=1e-3, steps=400 // (gbs * SEQ), loss=loss, train_loss=loss,
            seconds=seconds, steady_seconds=seconds,
        )  # fmt: skip

    return ProbeOutcome(
        stage=1, iteration=at_tokens // (4 * SEQ), consumed_samples=at_tokens // SEQ, samples=50, tokens=400,
        start_loss=4.0, current=branch(4, 3.9, 4.0), candidate=branch(8, 3.99, 2.2), tolerance=0.01,
        winner="current", reason="recorded: the candidate's loss drop per second is not larger", wall_s=6.5,
    )  # fmt: skip


def test_the_replay_probes_where_the_noise_model_alone_would_stay_and_the_world_answers():
    # Noise scale 1: the model values gbs 8's tokens at (1+4)/(1+8) of gbs 4's, 0.56 x 1.8 = 1.0x: no switch.
    model_only = dataclasses.replace(PROBING, probe=False, in_place=False)
    alone = simulate((SMALL, LARGE), profile(1.0), policy=model_only, switch_cost_s=0.0, seq=SEQ)
    assert alone.online.switches == 0
    probed = simulate((SMALL, LARGE), profile(1.0), policy=PROBING, switch_cost_s=0.0, seq=SEQ)
    kinds = [record["decision"] for record in probed.decisions]
    assert kinds[:2] == ["probe", "stay"]  # the world's answer is the model's here: the same progress rate
    assert probed.decisions[1]["probe"]["winner"] == "current"
    lost_s = probed.decisions[1]["probe"]["candidate_steady_s"]
    assert lost_s == pytest.approx(400 / 180.0)
    assert probed.online.time_s == pytest.approx(probed.static[0].time_s + lost_s * kinds.count("stay"))


def test_a_recorded_outcome_of_the_same_batches_nearby_answers_the_replays_probe():
    world = simulate((SMALL, LARGE), profile(100.0), policy=PROBING, switch_cost_s=0.0, seq=SEQ)
    assert [record["decision"] for record in world.decisions][:2] == ["probe", "switch"]
    first = world.decisions[0]["consumed_tokens"]
    recorded = simulate((SMALL, LARGE), profile(100.0), policy=PROBING, switch_cost_s=0.0, seq=SEQ,
                        probes=(lost_probe(first),))  # fmt: skip
    answer = recorded.decisions[1]
    assert answer["decision"] == "stay" and answer["probe"]["candidate_loss"] == 3.99
    assert "recorded" in answer["reason"]


def test_a_trace_reads_the_probes_beside_its_metrics_and_refuses_a_bad_line(tmp_path):
    rows = [
        {"stage": 1, "iteration": i, "consumed_samples": 4 * i, "consumed_tokens": 32 * i, "loss": 4.0,
         "gbs": 4, "gns_small_sqr": 3.0, "gns_big_sqr": 1.5, "gns_small_batch": 1, "gns_big_batch": 4}
        for i in range(1, 40)
    ]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    probe = lost_probe(64)
    lines = [
        json.dumps({"stage": 1, "iteration": 3, "skipped": "too close to the end"}),
        json.dumps(probe.to_dict()),
    ]
    (tmp_path / "probes.jsonl").write_text("\n".join(lines) + "\n")
    assert read_trace(tmp_path, training=PROBING_TRAINING).probes == (probe,)
    (tmp_path / "probes.jsonl").write_text('{"stage": 1}\n')
    with pytest.raises(PlanError, match=r"probes.jsonl: line 1 is not a probe record"):
        read_trace(tmp_path, training=PROBING_TRAINING)
