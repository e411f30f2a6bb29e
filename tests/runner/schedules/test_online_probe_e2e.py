"""An online run on one CPU process decides its in-place switch by a paired probe, end to end."""

from __future__ import annotations

import dataclasses
import json

import pytest
from tests.helpers.observed import TRACE_ENV, assert_each_sample_once_in_order, assert_lr_follows_schedule
from tests.helpers.tiny_runs import in_place_run

from cona.runner.schedules.online import run_online
from cona.runner.worker_session import WorkerSession

ITERS = 60
PROBE_TOKENS = 8 * 64
"""Eight samples of the test's seq 64: four steps at gbs 2, two at gbs 4."""


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_probe_trains_its_samples_twice_and_the_run_each_sample_once(tmp_path, monkeypatch):
    for name, value in TRACE_ENV.items():
        monkeypatch.setenv(name, value)
    run, raw = in_place_run(tmp_path, total_iters=ITERS)
    overrides = {**run.policy_overrides, "probe": True, "probe_tokens": PROBE_TOKENS, "probe_tolerance": 1.0}
    run = dataclasses.replace(run, policy_overrides=overrides)
    lines: list[str] = []
    with WorkerSession() as session:
        state = run_online(run, launcher=session, out=lines.append)

    probes = [json.loads(line) for line in (run.run_dir / "probes.jsonl").read_text().splitlines()]
    assert probes and "skipped" not in probes[0], probes
    first = probes[0]
    assert (first["current"]["gbs"], first["candidate"]["gbs"]) == (2, 4)
    assert (first["samples"], first["current"]["steps"], first["candidate"]["steps"]) == (8, 4, 2)
    decisions = [json.loads(line) for line in (run.run_dir / "decisions.jsonl").read_text().splitlines()]
    asked = [d for d in decisions if d["decision"] == "probe"]
    answered = [d for d in decisions if "probe" in d]
    assert asked and answered and answered[0]["probe"]["winner"] == first["winner"]
    assert answered[0]["decision"] == ("switch" if first["winner"] == "candidate" else "stay")
    if first["winner"] == "candidate":  # the stage ended where the probe began; the next continued in place
        assert state.stages[0].last_iteration == first["iteration"]
        assert state.stages[0].checkpoint is None
        assert any(line.startswith("stage 1 -> 2: switch in place to") for line in lines), lines
    # Whichever branch won: the run's steps took each sample once, in order, at its gbs's LR.
    trained = assert_each_sample_once_in_order(run.run_dir, total_samples=state.stages[-1].consumed_samples)
    assert_lr_follows_schedule(trained, raw, rule="sqrt", decay_tokens=raw["training"]["lr_decay_tokens"])
