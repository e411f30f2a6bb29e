"""The online search thread on synthetic metrics, and the online runner with a fake streaming engine."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import threading
import time
from pathlib import Path

import pytest
from chain_fakes import FakeEngine, chain_run, write_tiny_config
from test_train_cli import free_port_base, write_tiny_setup

from cona.cli import main
from cona.commands.demo import demo_config, demo_system
from cona.commands.train_runs import online_run as online_run_from_args
from cona.config import parse_config
from cona.config.file import load_config
from cona.engine.checkpoint.info import read_checkpoint_info
from cona.engine.checkpoint.paths import layout_dir
from cona.engine.spec import StageResult
from cona.errors import ConaError, LaunchError
from cona.jsonl import JsonlTail
from cona.planner.efficiency import MIN_SAMPLES, NoiseScaleTracker
from cona.planner.policy import Candidate, PolicySettings, initial_state
from cona.runner.chain_file import load_chain
from cona.runner.nodes.multinode import NodePlacement, cona_command
from cona.runner.schedules.chain_schedule import StageLaunch, run_chain
from cona.runner.schedules.online import OnlineRun, run_online
from cona.runner.schedules.online_search import Budget, StageSearch
from cona.strategy import Strategy

SEQ = 8
SMALL = Strategy(dp=2, tp=2, pp=1, mbs=1, gbs=2)
LARGE = Strategy(dp=4, tp=1, pp=1, mbs=1, gbs=4)


def metrics_record(iteration: int, gbs: int, *, noise_scale: float, grad_sqr: float = 1.0, **extra) -> dict:
    """A metrics line whose two-batch inputs give exactly ``noise_scale`` (|G|^2 = ``grad_sqr``)."""
    trace = noise_scale * grad_sqr
    return {
        "stage": 1,
        "iteration": iteration,
        "consumed_samples": iteration * gbs,
        "consumed_tokens": iteration * gbs * SEQ,
        "gbs": gbs,
        "step_time_s": 0.1,
        "steps_in_interval": 1,
        "tokens_per_s": 1000.0,
        "gns_small_sqr": grad_sqr + trace / 1,
        "gns_big_sqr": grad_sqr + trace / gbs,
        "gns_small_batch": 1,
        "gns_big_batch": gbs,
        "time": time.time(),
        **extra,
    }


def make_search(run_dir: Path, *, predicted: float, cost_s: float = 1.0, target_ppl=None) -> StageSearch:
    settings = PolicySettings(base_gbs=2, max_gbs=8, predicted_switch_cost_s=cost_s, hysteresis=0.0)
    frontier = {4: Candidate(strategy=LARGE, predicted_tokens_per_s=predicted)}
    return StageSearch(
        run_dir=run_dir,
        stage=1,
        launched_at=time.time(),
        settings=settings,
        policy_state=initial_state(Candidate(strategy=SMALL, predicted_tokens_per_s=1000.0)),
        tracker=NoiseScaleTracker(base_batch=2),
        frontier=frontier.get,
        budget=Budget(total_iters=100_000, total_tokens=None, target_ppl=target_ppl, seq=SEQ),
        out=lambda line: None,
    )


def append(run_dir: Path, records: list[dict]) -> None:
    with open(run_dir / "metrics.jsonl", "a") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")


def decisions(run_dir: Path) -> list[dict]:
    path = run_dir / "decisions.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


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


STEP_S = 0.02
"""A step of stage 1: the search thread (polling every 0.05 s) sees a few lines a poll and decides within
the stage's first lines (it switched at iteration 8 of 150)."""
LATER_STEP_S = 0.005
"""A step of a later stage (after the switch, at the largest gbs): the search still polls it over a dozen
times (the tests need it to go on there), without waiting out ~140 steps at stage 1's pace."""


class StreamingEngine:
    """A launcher that appends a metrics line per step (noise scale 1000, throughput growing with gbs) and
    honours switch_request.json at step boundaries as the worker does; checkpoints via FakeEngine."""

    def __init__(self, *, late_request: bool = False) -> None:
        self.launches: list[StageLaunch] = []
        self.late_request = late_request
        """Complete every stage, and only then find a switch request (the search decided too late)."""

    def __call__(self, launch: StageLaunch) -> None:
        self.launches.append(launch)
        spec = launch.spec
        state = read_checkpoint_info(spec.load_path).trainer_state if spec.load_path else {}
        iteration, tokens = state.get("iteration", 0), state.get("consumed_tokens", 0)
        samples, gbs = state.get("consumed_samples", 0), spec.strategy.gbs
        started, reason = time.time(), "completed"
        while iteration < spec.target_iteration:
            iteration, samples, tokens = iteration + 1, samples + gbs, tokens + gbs * SEQ
            record = metrics_record(iteration, gbs, noise_scale=1000.0, tokens_per_s=50.0 * gbs)
            append(spec.run_dir, [{**record, "stage": spec.stage, "consumed_samples": samples,
                                   "consumed_tokens": tokens}])  # fmt: skip
            time.sleep(STEP_S if spec.stage == 1 else LATER_STEP_S)
            if spec.switch_request_path.exists() and not self.late_request:
                reason = "switch_requested"
                break
        if self.late_request:
            request = {"action": "switch", "in_place": False, "strategy": dataclasses.asdict(LARGE),
                       "predicted_tokens_per_s": 1.0, "reason": "late"}  # fmt: skip
            spec.switch_request_path.write_text(json.dumps(request))
        target_dir = layout_dir(spec.workdir, spec.config, spec.strategy, "fp32", run_name=spec.run_name)
        checkpoint = FakeEngine._save(spec, target_dir, iteration, samples, tokens)
        now = time.time()
        timings = {"launch": started, "process_start": started, "setup_done": started,
                   "first_step_done": started, "train_done": now, "save_done": now}  # fmt: skip
        StageResult(
            stage=spec.stage,
            reason=reason,
            last_iteration=iteration,
            consumed_samples=samples,
            consumed_tokens=tokens,
            checkpoint=str(checkpoint),
            timings=timings,
        ).write(spec.result_path)


def tiny_online_run(tmp_path: Path, **overrides) -> OnlineRun:
    """An online run of the tiny config on 4 CPU workers, gbs 2 -> 4, 150 iterations, no hysteresis."""
    write_tiny_config(tmp_path)
    return OnlineRun(
        config=load_config(tmp_path / ".conaconfig"),
        workdir=tmp_path,
        run_dir=tmp_path / "logs" / "online",
        world_size=4,
        device_type="cpu",
        system="cpu_gloo",
        initial_gbs=2,
        max_gbs=4,
        total_iters=150,
        botorch=False,
        policy_overrides={"hysteresis": 0.0},
        **overrides,
    )


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
    write_tiny_config(replay_dir)
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


def test_online_options_name_the_missing_or_wrong_flag(tmp_path):
    config = write_tiny_setup(tmp_path)
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


def test_online_flags_across_nodes_give_the_placement_and_the_other_nodes_command(tmp_path, monkeypatch):
    config = write_tiny_setup(tmp_path)
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
