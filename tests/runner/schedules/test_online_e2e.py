"""An online run of a tiny GPT on 2 CPU processes switches, and ``cona train --chain`` replays what it did."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
from tests.helpers.observed import TRACE_ENV, assert_each_sample_once_in_order, assert_lr_follows_schedule
from tests.helpers.tiny_runs import free_port_base, in_place_run

from cona.cli import main
from cona.config.file import load_config
from cona.runner.run_dir import resolve_log_root
from cona.runner.schedules.online import OnlineRun, run_online
from cona.runner.state import load_state
from cona.runner.worker_session import WorkerSession

TOTAL_ITERS = 60
IN_PLACE_ITERS = 100
"""With the wider model below, long enough (seconds) that the search thread, which polls every 0.05 s
(online_search.POLL_INTERVAL_S) and decides at the run's first lines, switches well before the end, also
on a busy machine: the switch came at iterations 7-9 of 100 in three runs here."""


@pytest.mark.slow
@pytest.mark.multiproc
def test_an_online_run_switches_and_the_realized_chain_replays_it(tmp_path, monkeypatch, tiny_config_file):
    for name, value in TRACE_ENV.items():  # the workers record what they train on
        monkeypatch.setenv(name, value)
    config_path = tiny_config_file(data="random", training={"log_interval": 1, "eval_interval": 100})
    raw = json.loads(config_path.read_text())
    config = resolve_log_root(load_config(config_path))
    run = OnlineRun(
        config=config,
        workdir=tmp_path / "work",
        run_dir=tmp_path / "logs" / "online",
        world_size=2,
        device_type="cpu",
        system="cpu_gloo",
        initial_gbs=1,  # 2 processes share one sample only by tensor parallelism: gbs 2 changes the layout
        max_gbs=2,
        total_iters=TOTAL_ITERS,
        botorch=False,
        base_port=free_port_base(),
        quiet=True,
        # A 60-iteration run measures a noise scale of a few samples, where no larger batch pays, and
        # its restart costs more than the rest of the run: decide as a long run would.
        noise_scale_floor=1000.0,
        policy_overrides={"predicted_switch_cost_s": 0.0},
    )
    lines: list[str] = []
    with WorkerSession() as session:  # as `cona train` runs it: both stages in the same processes
        state = run_online(run, launcher=session, out=lines.append)

    assert len(state.stages) == 2 and state.stages[-1].last_iteration == TOTAL_ITERS
    decisions = [json.loads(line) for line in (run.run_dir / "decisions.jsonl").read_text().splitlines()]
    switch = [d for d in decisions if d["decision"] == "switch"]
    assert len(switch) == 1 and switch[0]["stage"] == 1
    assert switch[0]["current"]["strategy"]["tp"] == 2 and switch[0]["candidate"]["strategy"]["dp"] == 2
    assert switch[0]["measured_noise_scale"] is not None and switch[0]["time_saved_s"] > 0
    assert any(line.startswith("stage 1 -> 2: switch to dp2/tp1/pp1") for line in lines)
    summary = next(line for line in lines if "pred/meas" in line)  # the summary table, a line of its own
    why = {row.split()[3]: row for row in summary.splitlines() if len(row.split()) > 3}  # column "why"
    assert " prior " in why["initial"] and " fit on 1 " in why["switch"], summary  # what each rested on
    # What the workers trained on across the switch, and the LR they applied (sqrt rule, base_gbs 8;
    # the schedule's horizon is --total-iters at the initial gbs).
    trained = assert_each_sample_once_in_order(run.run_dir, total_samples=state.stages[-1].consumed_samples)
    assert {len(step.sample_ids) for step in trained} == {1, 2}
    assert_lr_follows_schedule(trained, raw, rule="sqrt", decay_tokens=TOTAL_ITERS * 1 * raw["model"]["seq"])

    replay_args = ["train", "--chain", str(run.run_dir / "realized_chain.json"), "--config", str(config_path)]
    replay_args += ["--gpus", "2", "--workdir", str(tmp_path / "replay"), "--run-name", "replay", "--quiet"]
    assert main([*replay_args, "--master-port-base", str(free_port_base())]) == 0
    replayed = load_state(tmp_path / "logs" / "replay")
    books = [(s.last_iteration, s.consumed_samples, s.consumed_tokens) for s in replayed.stages]
    assert books == [(s.last_iteration, s.consumed_samples, s.consumed_tokens) for s in state.stages]
    online_layouts = [
        json.loads(line)["dp"] for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    replay_metrics = (tmp_path / "logs" / "replay" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["dp"] for line in replay_metrics] == online_layouts
    assert dataclasses.asdict(replayed.stages[0])["status"] == "done"


def _losses(run_dir) -> dict[int, float]:
    """Each iteration's last logged loss (a retrained iteration is logged again)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {record["iteration"]: record["loss"] for record in records}


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_gbs_only_switch_happens_in_place_and_trains_as_the_checkpointed_switch(tmp_path, monkeypatch):
    for name, value in TRACE_ENV.items():
        monkeypatch.setenv(name, value)
    run, raw = in_place_run(tmp_path, total_iters=IN_PLACE_ITERS)
    config_path = tmp_path / ".conaconfig"
    lines: list[str] = []
    with WorkerSession() as session:
        state = run_online(run, launcher=session, out=lines.append)

    assert len(state.stages) == 2 and any(
        line.startswith("stage 1 -> 2: switch in place to") for line in lines
    )
    assert state.stages[0].checkpoint is None  # nothing saved at the switch
    total = state.stages[-1].consumed_samples
    trained = assert_each_sample_once_in_order(run.run_dir, total_samples=total)
    assert_lr_follows_schedule(trained, raw, rule="sqrt", decay_tokens=raw["training"]["lr_decay_tokens"])

    # The same chain through a checkpoint (chain mode saves, loads and verifies at every switch): the same
    # losses step by step, and the in-place gap is a fraction of that switch's.
    replay_args = ["train", "--chain", str(run.run_dir / "realized_chain.json"), "--config", str(config_path)]
    replay_args += ["--gpus", "1", "--workdir", str(tmp_path / "replay"), "--run-name", "replay", "--quiet"]
    assert main([*replay_args, "--master-port-base", str(free_port_base())]) == 0
    replay_dir = tmp_path / "logs" / "replay"
    replayed = load_state(replay_dir)
    assert replayed.stages[0].checkpoint is not None
    in_place_losses = _losses(run.run_dir)
    assert sorted(in_place_losses) == list(range(1, IN_PLACE_ITERS + 1))
    assert list(in_place_losses.values()) == pytest.approx(list(_losses(replay_dir).values()), rel=1e-6)
    # The switch itself (everything but the first step at the new batch shape, which both pay and which a
    # busy CPU stretches): the in-place one skips the probe, save, publish, load and verification.
    in_place_cost, checkpoint_cost = state.stages[1].switch_cost, replayed.stages[1].switch_cost
    assert {"probe_s", "publish_s", "verify_s"}.isdisjoint(in_place_cost), in_place_cost
    in_place_gap, checkpoint_gap = (
        sum(value for key, value in cost.items() if key != "first_step_s")
        for cost in (in_place_cost, checkpoint_cost)
    )
    assert in_place_gap <= 0.25 * checkpoint_gap, (in_place_cost, checkpoint_cost)

    # A kill in stage 2 before it saved loses the state the switch kept in memory: the same command
    # retrains stage 1 up to the switch and finishes, with the same samples and losses.
    switch_iteration = state.stages[0].last_iteration
    run_state_path = run.run_dir / "runner_state.json"
    books = json.loads(run_state_path.read_text())
    books["stages"][1].update(status="running", checkpoint=None, last_iteration=None, attempts=1)
    run_state_path.write_text(json.dumps(books))
    (run.run_dir / "stages" / "2" / "stage_result.json").unlink()
    for checkpoint in (tmp_path / "work" / "checkpoints").rglob("global_step*"):
        shutil.rmtree(checkpoint)
    for marker in (tmp_path / "work" / "checkpoints").rglob("latest"):
        marker.unlink()
    lines.clear()
    with WorkerSession() as session:
        resumed = dataclasses.replace(run, base_port=free_port_base())
        state = run_online(resumed, launcher=session, out=lines.append)
    assert any(line.startswith(f"stage 1: retraining iterations 0..{switch_iteration}") for line in lines)
    assert state.stages[-1].consumed_samples == total
    assert_each_sample_once_in_order(run.run_dir, total_samples=total)
    assert list(_losses(run.run_dir).values()) == pytest.approx(list(in_place_losses.values()), rel=1e-6)
