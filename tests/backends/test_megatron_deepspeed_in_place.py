"""In-place gbs switches of the Megatron-DeepSpeed backend, on CPU without a checkout.

The launched side runs against a loop that does what ``megatron.training.train`` does around
``train_step`` (the calculator's micro-batches at the top of each iteration, DeepSpeed told, the samples
added after the step) over a sampler that hands out micro-batches of consecutive sample ids, as
``MegatronPretrainingSampler`` does; the runner's side against real child processes.
"""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys
import textwrap
from contextlib import redirect_stdout
from pathlib import Path
from types import SimpleNamespace

import pytest

from cona.backends.megatron_deepspeed.commands import online_shape
from cona.backends.megatron_deepspeed.environment import LAUNCHED_DIR, MdsEnvironment
from cona.backends.megatron_deepspeed.handover import Held, HeldLaunch, continue_command
from cona.backends.megatron_deepspeed.log_parse import MetricsRecorder, parse_handover_line
from cona.backends.megatron_deepspeed.output import follow
from cona.backends.megatron_deepspeed.stage import MdsBackend
from cona.config import parse_config
from cona.engine.optim import LRSchedule
from cona.engine.spec import StageSpec
from cona.errors import LaunchError
from cona.runner.launch import Topology
from cona.runner.stage_run import StageLaunch
from cona.strategy import Strategy

sys.path.insert(0, str(LAUNCHED_DIR))  # as in the launched processes: the entry script's folder
import cona_in_place  # noqa: E402
from cona_megatron_hooks import install  # noqa: E402

SEQ = 5


class Calculator:
    """``ConstantNumMicroBatches``: its constructor's checks and ``get``."""

    def __init__(self, global_batch_size: int, micro_batch_size: int, data_parallel_size: int) -> None:
        assert global_batch_size % (micro_batch_size * data_parallel_size) == 0
        self.num_micro_batches = global_batch_size // (micro_batch_size * data_parallel_size)

    def get(self) -> int:
        return self.num_micro_batches


class Scheduler:
    """Megatron's token-based scheduler, linear warmup then constant, with its ``step``."""

    def __init__(self, max_lr: float, min_lr: float, warmup_tokens: int, decay_tokens: int) -> None:
        self.max_lr, self.min_lr = max_lr, min_lr
        self.lr_warmup_tokens, self.lr_decay_tokens = warmup_tokens, decay_tokens
        self.num_tokens, self.num_steps, self.lr = 0, 0, 0.0

    def step(self, increment: int, token_num: int) -> None:
        self.num_tokens, self.num_steps = token_num, self.num_steps + increment
        self.lr = self.max_lr * min(1.0, self.num_tokens / self.lr_warmup_tokens)


class FakeMegatron:
    """What the hooks see of one Megatron-DeepSpeed process (dp 1, mbs 1): ``megatron.training``, its
    args, the global calculator, the DeepSpeed engine, and the sample ids each iteration trained on."""

    def __init__(self, *, gbs: int, train_tokens: int | None) -> None:
        self.args = SimpleNamespace(
            curr_iteration=0, log_interval=1, global_batch_size=gbs, seq_length=SEQ, micro_batch_size=1,
            data_parallel_size=1, consumed_train_samples=0, consumed_train_tokens=0, train_samples=1000,
            train_iters=1000 // gbs, train_tokens=train_tokens, lr=1e-3, min_lr=1e-4,
            lr_warmup_tokens=200, lr_decay_tokens=2000,
        )  # fmt: skip
        self.global_vars = SimpleNamespace(_GLOBAL_NUM_MICROBATCHES_CALCULATOR=Calculator(gbs, 1, 1))
        self.scheduler = Scheduler(1e-3, 1e-4, 200, 2000)
        self.engine = SimpleNamespace(train_batch_size=None, named_parameters=lambda: [])
        self.builds, self.evaluated = 0, []
        self.engine.set_train_batch_size = lambda size: setattr(self.engine, "train_batch_size", size)
        self.samples = iter(range(1000))  # the sampler: consecutive ids from consumed_train_samples on
        self.trained: list[list[int]] = []
        self.lrs: list[float] = []
        mpu = SimpleNamespace(
            get_tensor_model_parallel_world_size=lambda: 1, get_data_parallel_world_size=lambda: 1,
            get_data_parallel_group=lambda: None,
        )  # fmt: skip
        self.training = SimpleNamespace(
            get_args=lambda: self.args, get_num_microbatches=self.num_microbatches, mpu=mpu,
            is_last_rank=lambda: True, train_step=self._train_step,
            setup_model_and_optimizer=lambda: ([self.engine], None, self.scheduler),
            build_train_valid_test_data_iterators=self._build, evaluate_and_print_results=self._evaluate,
        )  # fmt: skip

    def _build(self, provider: str) -> tuple:
        """Megatron's data iterators, named by how many builds there were."""
        assert provider == "provider"
        self.builds += 1
        return tuple(SimpleNamespace(name=f"{kind}{self.builds}") for kind in ("train", "valid", "test"))

    def _evaluate(self, prefix, forward_step_func, data_iterator, *args, **kwargs) -> None:
        self.evaluated.append(data_iterator.name)

    def num_microbatches(self) -> int:
        return self.global_vars._GLOBAL_NUM_MICROBATCHES_CALCULATOR.get()

    def _train_step(self) -> None:
        self.lrs.append(self.scheduler.lr)
        self.trained.append([next(self.samples) for _ in range(self.num_microbatches())])
        # DeepSpeed's step: the scheduler at the tokens before this step's
        self.scheduler.step(self.num_microbatches(), token_num=self.args.consumed_train_tokens)

    def train(self) -> str:
        """Megatron's loop; returns what the last rank printed."""
        args, printed = self.args, io.StringIO()
        with redirect_stdout(printed):
            self.training.setup_model_and_optimizer()
            _, valid, test = self.training.build_train_valid_test_data_iterators("provider")
            iteration = 0
            while iteration < args.train_iters and (
                args.train_tokens is None or args.consumed_train_tokens < args.train_tokens
            ):
                self.engine.set_train_batch_size(self.num_microbatches())  # dp * mbs = 1
                args.curr_iteration = iteration
                self.training.train_step()
                iteration += 1
                args.consumed_train_samples += self.num_microbatches()
                args.consumed_train_tokens += self.num_microbatches() * SEQ
                print(f" iteration {iteration:8d}/ {args.train_iters:7d} | consumed samples: "
                      f"{args.consumed_train_samples} | global batch size: {self.num_microbatches()} | "
                      f"lm loss: 1.0E+01 |")  # fmt: skip
            for draw in (valid, test):  # the final evaluations after the loop
                self.training.evaluate_and_print_results("final", None, draw, None, iteration)
        return printed.getvalue()


def _hooks(megatron: FakeMegatron, env: dict[str, str]):
    hooks = install(megatron.training, env)
    hooks.batch_modules = lambda: (megatron.global_vars, Calculator)
    return hooks


def _command(tmp_path, iteration: int, **values) -> None:
    command = {"stage": 2, "gbs": 4, "mbs": 1, "lr": 2e-3, "min_lr": 2e-4, "warmup_tokens": 200,
               "decay_tokens": 2000, "train_tokens": None, "stop_iteration": 5,
               "hand_over_at_stop": False}  # fmt: skip
    (tmp_path / f"continue-{iteration}.json").write_text(json.dumps({**command, **values}))


def test_an_in_place_request_hands_over_and_the_next_stage_trains_on_in_the_same_loop(tmp_path):
    request = tmp_path / "switch_request.json"
    megatron = FakeMegatron(gbs=2, train_tokens=10_000)
    step = megatron.training.train_step

    def requested_during_two():
        step()
        if megatron.args.curr_iteration == 1:
            request.write_text(json.dumps({"action": "switch", "in_place": True}))

    megatron.training.train_step = requested_during_two
    _command(tmp_path, 2, stop_iteration=4)
    env = {"CONA_MDS_SWITCH_REQUEST": str(request), cona_in_place.HANDOVER_DIR_ENV: str(tmp_path)}
    hooks = _hooks(megatron, env)
    request_seen = megatron.training.train_step

    def request_consumed(*args, **kwargs):  # the runner removes the request before it continues
        if hooks.handover is not None:
            request.unlink()
        return request_seen(*args, **kwargs)

    megatron.training.train_step = request_consumed
    output = megatron.train()

    # Stage 1 ends after iteration 2 (its log line included), stage 2 trains 3 and 4 at gbs 4.
    lines = output.splitlines()
    handover = next(i for i, line in enumerate(lines) if parse_handover_line(line) == 2)
    assert "iteration        2/" in lines[handover - 1]
    assert "reason: switch_in_place" in output and "cona stop | iteration 4 |" in output
    assert "reason: completed" in lines[-2]  # the new stop iteration, from the command
    assert megatron.trained == [[0, 1], [2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]  # every sample once, in order
    assert megatron.args.consumed_train_samples == 12 and megatron.engine.train_batch_size == 4
    assert megatron.args.global_batch_size == 4 and megatron.args.train_iters == 4
    # Step 3, the first after the switch, trains at the new rule (peak 2e-3) at the tokens before it, not at
    # the LR the old rule set after step 2; step 4 at the new rule at the tokens before step 3.
    assert megatron.lrs[2] == pytest.approx(2e-3 * 10 / 200) and megatron.scheduler.num_steps == 12
    assert megatron.lrs[3] == pytest.approx(2e-3 * 20 / 200) and megatron.args.lr == 2e-3
    # The final evaluations draw from the datasets built again for gbs 4 (Megatron sized its own for 2).
    assert megatron.builds == 2 and megatron.evaluated == ["valid2", "test2"]

    records: list[dict] = []
    recorder = MetricsRecorder(stage=1, strategy=Strategy(dp=1, tp=1, pp=1, mbs=1, gbs=2), seq=SEQ,
                               write=records.append, previous_iteration=0)  # fmt: skip
    for line in lines[:handover]:
        recorder.feed(line)
    recorder.flush()
    assert [r["iteration"] for r in records] == [1, 2] and recorder.stop.reason == "switch_in_place"


def test_a_request_when_the_loop_ends_anyway_and_a_process_without_a_handover_dir_save(tmp_path):
    request = tmp_path / "switch_request.json"
    request.write_text(json.dumps({"action": "switch", "in_place": True}))
    env = {"CONA_MDS_SWITCH_REQUEST": str(request), cona_in_place.HANDOVER_DIR_ENV: str(tmp_path)}
    budget = FakeMegatron(gbs=2, train_tokens=2 * SEQ)  # --train-tokens reached after step 1
    _hooks(budget, env)
    assert "reason: switch_requested" in budget.train() and budget.args.train_iters == 1
    no_dir = FakeMegatron(gbs=2, train_tokens=None)
    _hooks(no_dir, {"CONA_MDS_SWITCH_REQUEST": str(request)})
    output = no_dir.train()
    assert "reason: switch_requested" in output and "cona handover" not in output
    assert budget.evaluated == no_dir.evaluated == ["valid1", "test1"]


def test_a_chain_step_hands_over_at_its_stop_iteration(tmp_path):
    megatron = FakeMegatron(gbs=2, train_tokens=3 * 2 * SEQ)
    _command(tmp_path, 3, train_tokens=5 * 4 * SEQ, stop_iteration=5, gbs=4)
    env = {"CONA_MDS_STOP_ITERATION": "3", cona_in_place.HAND_OVER_AT_STOP_ENV: "1"}
    _hooks(megatron, {**env, cona_in_place.HANDOVER_DIR_ENV: str(tmp_path)})
    output = megatron.train()
    assert "cona stop | iteration 3 | consumed samples: 6 | consumed tokens: 30 | reason: completed" in output
    assert "cona handover | iteration 3" in output
    assert [len(batch) for batch in megatron.trained] == [2, 2, 2, 4, 4]
    assert megatron.args.consumed_train_tokens == 70  # stopped by the command's stop iteration


def test_switch_batch_refuses_an_mbs_change_and_a_gbs_the_micro_batches_do_not_divide():
    megatron = FakeMegatron(gbs=2, train_tokens=None)
    parts = {"args": megatron.args, "engine": megatron.engine, "scheduler": megatron.scheduler,
             "global_vars": megatron.global_vars, "calculator_class": Calculator}  # fmt: skip
    command = {"gbs": 4, "mbs": 2, "lr": 1.0, "min_lr": 0.1}
    with pytest.raises(SystemExit, match="mbs 1 -> 2 cannot change in process"):
        cona_in_place.switch_batch(command, **parts)
    megatron.args.data_parallel_size = 3
    with pytest.raises(SystemExit, match="gbs=4 is not a multiple of mbs\\*dp=3"):
        cona_in_place.switch_batch({**command, "mbs": 1}, **parts)
    assert megatron.num_microbatches() == 2  # nothing changed


def test_waiting_for_a_command_ends_when_the_runner_is_gone(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert cona_in_place.wait_for_command(str(tmp_path / "never.json"), runner_pid=gone.pid) is None
    (tmp_path / "here.json").write_text('{"gbs": 8}')
    assert cona_in_place.wait_for_command(str(tmp_path / "here.json"), runner_pid=gone.pid) == {"gbs": 8}


CHILD = textwrap.dedent(
    """
    import os, sys, time
    print("iteration 1 line", flush=True)
    print("cona handover | iteration 1", flush=True)
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.01)
    print("iteration 2 line", flush=True)
    """
)


def test_follow_stops_at_the_handover_line_and_the_next_stage_reads_on(tmp_path):
    command = tmp_path / "continue-1.json"
    process = subprocess.Popen([sys.executable, "-c", CHILD, str(command)], stdout=subprocess.PIPE, text=True)
    first, second, timings = io.StringIO(), io.StringIO(), {}
    lines: list[str] = []
    assert follow(process, first, lines.append, timings, {"started": "iteration 1"}) == (None, 1)
    assert process.poll() is None and "handover" in first.getvalue()
    command.write_text("{}")
    assert follow(process, second, lines.append, {}, {}) == (0, None)
    assert second.getvalue() == "iteration 2 line\n" and len(lines) == 3 and "started" in timings


def test_a_held_launch_continues_only_where_it_handed_over_and_is_stopped_otherwise(tmp_path):
    strategy = Strategy(dp=1, tp=1, pp=2, mbs=1, gbs=4)
    held = HeldLaunch()
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]

    def keep() -> subprocess.Popen:
        process = subprocess.Popen(sleeper)
        held.keep(Held(process=process, strategy=strategy, iteration=4, directory=tmp_path))
        return process

    process = keep()
    assert (
        held.take(iteration=4, strategy=Strategy(dp=1, tp=1, pp=2, mbs=1, gbs=8), stage=2).process is process
    )
    process.kill()
    process.wait()
    for iteration, other in ((5, strategy), (4, Strategy(dp=1, tp=1, pp=2, mbs=2, gbs=8))):
        process = keep()
        with pytest.raises(LaunchError, match="cannot continue as"):
            held.take(iteration=iteration, strategy=other, stage=2)
        assert process.poll() is not None  # the launch no stage continues is gone
    with pytest.raises(LaunchError, match="no Megatron-DeepSpeed launch waits"):
        held.take(iteration=4, strategy=strategy, stage=2)
    process = keep()
    held.stop()
    assert process.poll() is not None and held.held is None


def test_the_continue_command_carries_the_stage_s_lr_rule_and_stop_rules():
    schedule = LRSchedule(peak_lr=2e-3, min_lr=2e-4, warmup_tokens=256, decay_tokens=4096)
    command = continue_command(
        stage=2, strategy=Strategy(dp=2, tp=1, pp=1, mbs=1, gbs=8), schedule=schedule, train_tokens=2048,
        stop_iteration=7, hand_over_at_stop=True,
    )  # fmt: skip
    assert {key: command[key] for key in ("stage", "gbs", "mbs", "lr", "min_lr")} == {
        "stage": 2, "gbs": 8, "mbs": 1, "lr": 2e-3, "min_lr": 2e-4,
    }  # fmt: skip
    assert (command["warmup_tokens"], command["decay_tokens"], command["train_tokens"]) == (256, 4096, 2048)
    assert command["stop_iteration"] == 7 and command["hand_over_at_stop"] is True
    assert math.isfinite(command["written_at"])


def _launch(tmp_path, *, nnodes: int = 1, **spec_values) -> StageLaunch:
    model = {"name": "g", "layers": 2, "hidden": 64, "heads": 4, "seq": 64, "normalization": "rmsnorm"}
    config = parse_config({"model": model, "training": {"zero_stage": 1}}, source=None)
    spec = StageSpec(
        run_dir=tmp_path / "run", config=config, strategy=Strategy(dp=2, tp=1, pp=1, mbs=1, gbs=4), stage=1,
        workdir=tmp_path, planned_tokens=4096, target_iteration=6, **spec_values,
    )  # fmt: skip
    topology = Topology(nproc_per_node=2 // nnodes, master_port=29500, nnodes=nnodes)
    return StageLaunch(spec=spec, spec_path=tmp_path / "spec.json", topology=topology, device_type="cpu")


def test_the_hooks_hear_of_hand_overs_only_where_a_stage_may_hand_over_on_one_node(tmp_path):
    """The launch environment: the hand-over directory (emptied), the runner's pid and, for a stage that
    hands over at its stop (a chain step, a replay up to an in-place switch), the flag; none for a
    chain stage that cannot hand over, across nodes, or with in-place switches off."""
    mds = MdsEnvironment(repo=tmp_path / "repo", python=Path(sys.executable))
    config = _launch(tmp_path).spec.config
    shape = online_shape(config, world_size=2, max_samples=100)

    def hook_env(launch: StageLaunch, **backend) -> dict[str, str]:
        backend = MdsBackend(env=mds, shape=shape, device_type="cpu", base_env={}, **backend)
        return backend._hook_env(launch, training=True)

    stale = tmp_path / "run" / "mds_handover" / "continue-6.json"
    stale.parent.mkdir(parents=True)
    stale.write_text("{}")
    online = hook_env(_launch(tmp_path), switch_requests=True, in_place=True)
    assert online[cona_in_place.HANDOVER_DIR_ENV] == str(stale.parent) and not stale.exists()
    assert int(online[cona_in_place.RUNNER_PID_ENV]) > 0
    assert cona_in_place.HAND_OVER_AT_STOP_ENV not in online and online["CONA_MDS_STOP_ITERATION"] == "6"
    chain_step = hook_env(_launch(tmp_path, hand_over_in_place=True), in_place=True)
    assert chain_step[cona_in_place.HAND_OVER_AT_STOP_ENV] == "1"
    for launch, backend in (
        (_launch(tmp_path), {"in_place": True}),  # a chain stage that does not hand over
        (_launch(tmp_path, nnodes=2, hand_over_in_place=True), {"in_place": True}),
        (_launch(tmp_path, hand_over_in_place=True), {"in_place": False, "switch_requests": True}),
    ):
        assert cona_in_place.HANDOVER_DIR_ENV not in hook_env(launch, **backend)
