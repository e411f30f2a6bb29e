"""An online run of a tiny GPT on 2 CPU processes switches, and ``cona train --chain`` replays what it did."""

from __future__ import annotations

import dataclasses
import json

import pytest
from test_train_cli import free_port_base, write_tiny_setup

from cona.cli import main
from cona.config import load_config
from cona.runner.online import OnlineRun, run_online
from cona.runner.run_dir import resolve_log_root
from cona.runner.state import load_state
from cona.runner.worker_session import WorkerSession

TOTAL_ITERS = 60


@pytest.mark.slow
@pytest.mark.multiproc
def test_an_online_run_switches_and_the_realized_chain_replays_it(tmp_path):
    config_path = write_tiny_setup(tmp_path)
    raw = json.loads(config_path.read_text())
    raw["training"].update(log_interval=1, eval_interval=100)
    config_path.write_text(json.dumps(raw))
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
    assert any("online run online" in line for line in lines), "the summary table"

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
