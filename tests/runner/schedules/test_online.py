"""The online search thread on synthetic metrics, and the online runner with a fake streaming engine."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import threading
from pathlib import Path

import pytest
from tests.helpers.chain_fakes import FakeEngine, chain_run, write_fake_chain_config
from tests.helpers.online_fakes import (
    LARGE,
    StreamingEngine,
    append,
    decisions,
    make_search,
    metrics_record,
    tiny_online_run,
)
from tests.helpers.tiny_runs import free_port_base

from cona.cli import main
from cona.commands.demo import demo_config, demo_system
from cona.commands.train_runs import online_run as online_run_from_args
from cona.config import parse_config
from cona.errors import ConaError, LaunchError
from cona.jsonl import JsonlTail
from cona.planner.efficiency import MIN_SAMPLES
from cona.runner.chain_file import load_chain
from cona.runner.nodes.multinode import NodePlacement, cona_command
from cona.runner.schedules.chain_schedule import StageLaunch, run_chain
from cona.runner.schedules.online import OnlineRun, run_online
from cona.strategy import Strategy


def test_a_large_noise_scale_and_a_faster_frontier_request_a_switch(tmp_path):
    search = make_search(tmp_path, predicted=3000.0)
    for start in range(0, 30, 5):  # the file grows between polls, as the workers append
        append(tmp_path, [metrics_record(i, 2, noise_scale=1000.0) for i in range(start + 1, start + 6)])
        search.poll()
        if search.requested:
            break
    logged = decisions(tmp_path)
    assert [d["decision"] for d in logged][-1] == "switch"
    assert all(d["decision"] == "stay" for d in logged[:-1])
    assert logged[-1]["noise_samples"] >= MIN_SAMPLES and abs(logged[-1]["noise_scale"] - 1000.0) < 1e-6
    request = json.loads((tmp_path / "switch_request.json").read_text())
    assert request["action"] == "switch" and Strategy(**request["strategy"]) == LARGE
    before = len(logged)
    append(tmp_path, [metrics_record(40, 2, noise_scale=1000.0)])
    search.poll()
    assert len(decisions(tmp_path)) == before, "after a request the search waits for the runner"


def test_quiet_mode_says_no_stay_decision_but_logs_every_one(tmp_path):
    lines: list[str] = []
    search = make_search(tmp_path, predicted=1e9)
    search.out, search.print_stays = lines.append, False
    for iteration in range(1, MIN_SAMPLES):
        append(tmp_path, [metrics_record(iteration, 2, noise_scale=1000.0)])
        search.poll()
    assert [d["decision"] for d in decisions(tmp_path)] == ["stay"] * (MIN_SAMPLES - 1) and lines == []
    # each stay says how many of the measurements it needs the tracker holds
    assert [d["noise_samples"] for d in decisions(tmp_path)] == list(range(1, MIN_SAMPLES))
    append(tmp_path, [metrics_record(MIN_SAMPLES, 2, noise_scale=1000.0)])
    search.poll()  # enough measurements now: a switch, which quiet mode still says
    assert len(lines) == 1 and lines[0].startswith(f"decision at iteration {MIN_SAMPLES}: switch")


def test_an_unknown_noise_scale_never_requests_a_switch(tmp_path):
    search = make_search(tmp_path, predicted=1e9)
    append(tmp_path, [metrics_record(i, 2, noise_scale=1000.0, grad_sqr=-1.0) for i in range(1, 40)])
    for _ in range(3):
        search.poll()
    append(tmp_path, [metrics_record(i, 2, noise_scale=1000.0, grad_sqr=-1.0) for i in range(40, 45)])
    search.poll()
    logged = decisions(tmp_path)
    assert logged and all(d["decision"] == "stay" and d["noise_scale"] is None for d in logged)
    assert "not positive" in logged[-1]["reason"]
    assert not (tmp_path / "switch_request.json").exists()


def test_too_few_measurements_never_request_a_switch(tmp_path):
    search = make_search(tmp_path, predicted=1e9)
    for iteration in range(1, MIN_SAMPLES):
        append(tmp_path, [metrics_record(iteration, 2, noise_scale=1000.0)])
        search.poll()
    assert [d["decision"] for d in decisions(tmp_path)] == ["stay"] * (MIN_SAMPLES - 1)
    assert not (tmp_path / "switch_request.json").exists()


def test_a_frontier_that_wins_less_than_the_switch_cost_is_not_taken(tmp_path):
    search = make_search(tmp_path, predicted=1100.0, cost_s=1e6)
    append(tmp_path, [metrics_record(i, 2, noise_scale=1000.0) for i in range(1, 30)])
    search.poll()
    assert decisions(tmp_path)[-1]["decision"] == "stay"
    assert not (tmp_path / "switch_request.json").exists()


def test_reaching_the_target_perplexity_requests_a_stop(tmp_path):
    search = make_search(tmp_path, predicted=1000.0, target_ppl=50.0)
    append(tmp_path, [metrics_record(1, 2, noise_scale=1.0, eval_ppl=80.0)])
    search.poll()
    assert not (tmp_path / "switch_request.json").exists()
    append(tmp_path, [metrics_record(2, 2, noise_scale=1.0, eval_ppl=49.0)])
    search.poll()
    assert json.loads((tmp_path / "switch_request.json").read_text())["action"] == "stop"
    assert search.target_reached["iteration"] == 2


def test_the_tail_waits_for_the_end_of_a_half_written_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = JsonlTail(path)
    assert tail.new_records() == []
    path.write_text('{"iteration": 1}\n{"iterat')
    assert tail.new_records() == [{"iteration": 1}]
    with open(path, "a") as handle:
        handle.write('ion": 2}\n')
    assert tail.new_records() == [{"iteration": 2}]


def test_an_online_run_switches_and_its_realized_chain_replays(tmp_path):
    run = tiny_online_run(tmp_path)
    lines: list[str] = []
    engine = StreamingEngine()
    state = run_online(run, launcher=engine, out=lines.append)
    strategies = [launch.spec.strategy for launch in engine.launches]
    assert [s.gbs for s in strategies] == [2, 4]
    assert strategies[0].layout != strategies[1].layout
    assert state.stages[-1].last_iteration == 150
    assert any(line.startswith("stage 1 -> 2: switch to") for line in lines)
    logged = decisions(run.run_dir)
    switches = [d for d in logged if d["decision"] == "switch"]
    assert [(d["stage"], d["candidate"]["strategy"]["gbs"]) for d in switches] == [(1, 4)]
    assert logged[-1]["stage"] == 2, "the search goes on in the new stage"
    chain_path = run.run_dir / "realized_chain.json"
    config = run.config
    chain = load_chain(chain_path, config=config, world_size=4, dtype="fp32", workdir=tmp_path)
    assert [step.strategy(config).short() for step in chain.steps] == [s.short() for s in strategies]
    replay_dir = tmp_path / "replay"
    replay_dir.mkdir()
    write_fake_chain_config(replay_dir)
    replayed = run_chain(chain_run(replay_dir, chain_path), launcher=FakeEngine(), out=lambda line: None)
    assert [(s.last_iteration, s.consumed_samples) for s in replayed.stages] == [
        (s.last_iteration, s.consumed_samples) for s in state.stages
    ]


def test_a_switch_requested_after_the_stages_last_step_is_logged_as_not_carried_out(tmp_path):
    run = tiny_online_run(tmp_path)
    lines: list[str] = []
    state = run_online(run, launcher=StreamingEngine(late_request=True), out=lines.append)
    assert len(state.stages) == 1 and state.stages[0].last_iteration == 150
    (late,) = [d for d in decisions(run.run_dir) if d["decision"] == "not_carried_out"]
    assert (late["stage"], late["iteration"], late["requested"]) == (1, 150, "switch")
    assert late["strategy"]["gbs"] == LARGE.gbs and late["time"] == late["decided_at"] > 0
    assert any("not carried out" in line for line in lines)
    assert not (run.run_dir / "switch_request.json").exists()


def online_args(config: Path, **changes) -> argparse.Namespace:
    values = dict(config=str(config), gpus=2, system="cpu_gloo", initial_gbs=2, max_gbs=8, total_iters=10,
                  total_tokens=None, target_ppl=None, no_botorch=True)  # fmt: skip
    return argparse.Namespace(**{**values, **changes})


def test_online_options_name_the_missing_or_wrong_flag(tmp_path, tiny_config_file):
    config = tiny_config_file(data="random")
    run = online_run_from_args(online_args(config))
    assert (run.world_size, run.initial_gbs, run.max_gbs, run.botorch) == (2, 2, 8, False)
    assert run.planned_tokens == 10 * 2 * 16 and run.run_dir == (tmp_path / "logs" / "online").resolve()
    cases = [
        ({"system": None}, "missing --system"),
        ({"total_iters": None}, "give --total-iters, --total-tokens or --target-ppl"),
        ({"total_iters": None, "target_ppl": 30.0}, "set training.lr_decay_tokens"),
        ({"max_gbs": 1}, "--max-gbs 1 is below --initial-gbs 2"),
        ({"total_tokens": -5}, "--total-tokens: must be positive"),
    ]
    for changes, message in cases:
        with pytest.raises(ConaError, match=re.escape(message)):
            online_run_from_args(online_args(config, **changes))


class CrashingEngine(StreamingEngine):
    """Fails the launch of stage 2 (as a killed stage would), after stage 1 switched."""

    def __call__(self, launch: StageLaunch) -> None:
        if launch.spec.stage == 2:
            raise LaunchError("stage 2: rank 0 failed: killed")
        super().__call__(launch)


def test_rerunning_after_a_failed_stage_resumes_the_online_run(tmp_path):
    run = tiny_online_run(tmp_path)
    with pytest.raises(LaunchError):
        run_online(run, launcher=CrashingEngine(), out=lambda line: None)
    lines: list[str] = []
    engine = StreamingEngine()
    state = run_online(run, launcher=engine, out=lines.append)
    assert lines[0] == f"resuming online run online at stage 2 ({run.run_dir})"
    assert [launch.spec.strategy.gbs for launch in engine.launches] == [4]
    assert engine.launches[0].spec.load_path.name.endswith("_universal")
    assert [s.status for s in state.stages] == ["done", "done"] and state.stages[-1].last_iteration == 150


def test_the_demo_config_is_valid_and_does_not_depend_on_the_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    raw = demo_config(Path("/data/demo"), Path("/runs/demo/1"), device="cpu")
    config = parse_config(raw, source=None)
    assert config.training.data.data_prefix == "/data/demo/wiki_tiny_text_document"
    assert config.training.logging.log_root == "/runs/demo/1/logs" and config.training.runtime.dtype == "fp32"
    assert demo_system(None) == "cpu_gloo" and demo_system("NVIDIA H200") == "h200_141g"
    with pytest.raises(ConaError, match="no system description for the GPU 'Some GPU'"):
        demo_system("Some GPU")


def test_an_online_run_across_two_nodes_runs_each_stage_on_both(tmp_path):
    """Node 0 searches and decides; node 1's runner starts its share of every stage node 0 announces."""
    node0 = NodePlacement(num_nodes=2, gpus_per_node=2, hosts=("h0", "h1"))
    run = tiny_online_run(tmp_path, nodes=node0, base_port=free_port_base())  # the runners' store's port
    follower_run = dataclasses.replace(run, nodes=dataclasses.replace(node0, node_rank=1))
    followed: list[StageLaunch] = []
    follower = threading.Thread(target=run_online, args=(follower_run,), kwargs={"launcher": followed.append})
    follower.start()
    engine = StreamingEngine()
    state = run_online(run, launcher=engine, out=lambda line: None)
    follower.join(timeout=60)
    assert not follower.is_alive()
    assert [launch.spec.strategy.gbs for launch in engine.launches] == [2, 4]
    assert [launch.spec_path for launch in followed] == [launch.spec_path for launch in engine.launches]
    assert {(launch.topology.node_rank, launch.topology.nnodes, launch.topology.nproc_per_node)
            for launch in followed} == {(1, 2, 2)}  # fmt: skip
    assert engine.launches[0].topology.node_rank == 0 and state.stages[-1].last_iteration == 150


def test_online_flags_across_nodes_give_the_placement_and_the_other_nodes_command(
    tmp_path, monkeypatch, tiny_config_file
):
    config = tiny_config_file(data="random")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("127.0.0.1 slots=2\n127.0.0.2 slots=2\n")
    captured: list[OnlineRun] = []
    monkeypatch.setattr("cona.runner.schedules.online.run_online", lambda run, **_: captured.append(run))
    flags = ["--system", "cpu_gloo", "--initial-gbs", "2", "--max-gbs", "8", "--total-iters", "10"]
    placement = ["--num-nodes", "2", "--gpus-per-node", "2", "--hostfile", str(hostfile), "--no-ssh"]
    assert main(["train", "--config", str(config), *flags, *placement, "--node-rank", "1"]) == 0
    (run,) = captured
    assert (run.world_size, run.nodes.num_nodes, run.nodes.node_rank) == (4, 2, 1)
    command = cona_command(
        run.mode_args(), config=run.config, nodes=run.nodes, run_dir=run.run_dir, workdir=tmp_path,
        base_port=run.base_port, quiet=False,
    )  # fmt: skip
    assert " ".join(flags) in " ".join(command) and "--num-nodes 2" in " ".join(command)
