"""A kill after several in-place switches in a row: the rerun rebuilds the state in memory by retraining every
stage since the last one that started from a checkpoint (or from scratch), each continuing the one before in
place, and the run ends as the unkilled run ends. In process, with a launcher that keeps its "workers'"
state in memory as a worker session does and trains nothing but the books of which samples it took."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from tests.helpers.chain_fakes import FakeEngine, chain_run, write_fake_chain_config

from cona.config.file import load_config
from cona.engine.checkpoint.paths import layout_dir
from cona.engine.spec import StageResult, StageSpec
from cona.runner.schedules.chain_schedule import StageLaunch, run_chain
from cona.runner.schedules.online import OnlineRun, run_online
from cona.runner.state import load_state


class Killed(BaseException):
    """The stand-in for a SIGKILL of the runner and its workers."""


@dataclasses.dataclass
class Memory:
    """What a session's workers hold between stages: the counters and each step's sample window."""

    iteration: int = 0
    samples: int = 0
    windows: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    """(first sample, gbs) of every step the state has trained, in order."""


class MemoryEngine:
    """A launcher that keeps its workers (and so their state) between stages, as a worker session does:
    a stage continued in place takes the memory the stage before handed over, any other stage starts from
    scratch (the chains here never load a checkpoint). ``kill_stage``: the first launch of that stage kills
    the runner before it trains (the memory is lost with it)."""

    keeps_workers = True

    def __init__(
        self, kill_stage: int | None = None, switches: dict[int, tuple[int, int]] | None = None
    ) -> None:
        self.kill_stage = kill_stage
        self.switches = switches or {}
        """Online: stage -> (iteration, gbs) where the stage asks for an in-place switch to that gbs (as
        the search beside it would)."""
        self.memory: Memory | None = None
        self.specs: list[StageSpec] = []

    def __call__(self, launch: StageLaunch) -> None:
        spec = launch.spec
        self.specs.append(spec)
        if spec.stage == self.kill_stage and not spec.retraining:
            self.kill_stage = None
            raise Killed
        if spec.continue_in_place:
            assert self.memory is not None, f"stage {spec.stage}: nothing in memory to continue"
            assert self.memory.iteration == spec.start_iteration, (spec.stage, self.memory, spec)
            memory = self.memory
        else:
            assert spec.load_path is None, "these chains load no checkpoint"
            memory = Memory()
        self.memory = None
        gbs, reason = spec.strategy.gbs, "completed"
        stop, new_gbs = self.switches.get(spec.stage, (spec.target_iteration, None))
        if spec.retraining:  # a retraining stops where the stage stopped, on no request
            stop, new_gbs = spec.target_iteration, None
        while memory.iteration < stop:
            memory.windows.append((memory.samples, gbs))
            memory.iteration, memory.samples = memory.iteration + 1, memory.samples + gbs
        if new_gbs is not None:
            strategy = dataclasses.replace(spec.strategy, gbs=new_gbs)
            request = {"action": "switch", "in_place": True, "strategy": dataclasses.asdict(strategy),
                       "predicted_tokens_per_s": 1.0, "reason": "test"}  # fmt: skip
            spec.switch_request_path.write_text(json.dumps(request))
            reason = "switch_in_place"
        hand_over = spec.hand_over_in_place or new_gbs is not None
        seq = spec.config.model.seq
        checkpoint = None
        if not hand_over:
            target = layout_dir(spec.workdir, spec.config, spec.strategy, "fp32", run_name=spec.run_name)
            checkpoint = FakeEngine._save(
                spec, target, memory.iteration, memory.samples, memory.samples * seq
            )
            (checkpoint / "windows.json").write_text(json.dumps(memory.windows))
        else:
            self.memory = memory
        StageResult(
            stage=spec.stage,
            reason=reason,
            last_iteration=memory.iteration,
            consumed_samples=memory.samples,
            consumed_tokens=memory.samples * seq,
            checkpoint=str(checkpoint) if checkpoint is not None else None,
            timings={},
            handed_over=hand_over,
        ).write(spec.result_path)


STEPS = [  # one layout: every switch is in place
    {"gbs": 8, "train_iters": 3, "is_initial": True},
    {"gbs": 16, "extra_iters": 3},
    {"gbs": 4, "extra_iters": 2},
    {"gbs": 32, "extra_iters": 2},
]
WINDOWS = [(8 * i, 8) for i in range(3)] + [(24 + 16 * i, 16) for i in range(3)]
WINDOWS += [(72 + 4 * i, 4) for i in range(2)] + [(80 + 32 * i, 32) for i in range(2)]


def write_chain(tmp_path):
    write_fake_chain_config(tmp_path)
    steps = [{"step_num": n, "dp": 4, "tp": 1, "pp": 1, "mbs": 1, **s} for n, s in enumerate(STEPS, 1)]
    path = tmp_path / "chain.json"
    path.write_text(json.dumps({"steps": steps}))
    return dataclasses.replace(chain_run(tmp_path, path), switch_in_place=True)


@pytest.mark.parametrize("killed_stage", [3, 4])  # after two and after three in-place switches
def test_a_chain_killed_after_several_in_place_switches_retrains_every_stage_since_its_start(
    tmp_path, killed_stage
):
    run = write_chain(tmp_path)
    with pytest.raises(Killed):
        run_chain(run, launcher=MemoryEngine(kill_stage=killed_stage), out=lambda line: None)
    lines: list[str] = []
    engine = MemoryEngine()
    state = run_chain(run, launcher=engine, out=lines.append)

    replays, rest = engine.specs[: killed_stage - 1], engine.specs[killed_stage - 1 :]
    starts = [0, 3, 6, 8, 10]
    assert [(spec.stage, spec.continue_in_place, spec.start_iteration) for spec in replays] == [
        (n, n > 1, starts[n - 1] if n > 1 else None) for n in range(1, killed_stage)
    ]
    assert all(spec.retraining for spec in replays) and not any(spec.retraining for spec in rest)
    assert [spec.stage for spec in rest] == list(range(killed_stage, 5))
    assert [line for line in lines if "retraining" in line] == [
        f"stage {n}: retraining iterations {starts[n - 1]}..{starts[n]} to rebuild the state an in-place "
        "switch kept in memory"
        for n in range(1, killed_stage)
    ]
    last = state.stages[-1]
    assert [stage.status for stage in state.stages] == ["done"] * 4
    assert (last.last_iteration, last.consumed_samples) == (10, 144)
    assert json.loads((Path(last.checkpoint) / "windows.json").read_text()) == [list(w) for w in WINDOWS]
    assert load_state(run.run_dir).stages[-1].consumed_samples == 144


def online_run(tmp_path) -> OnlineRun:
    write_fake_chain_config(tmp_path)
    return OnlineRun(
        config=load_config(tmp_path / ".conaconfig"),
        workdir=tmp_path,
        run_dir=tmp_path / "logs" / "online",
        world_size=1,
        device_type="cpu",
        system="cpu_gloo",
        initial_gbs=8,
        max_gbs=32,
        total_iters=10,
        botorch=False,
    )


@pytest.mark.parametrize("killed_stage", [3, 4])  # after two and after three in-place switches
def test_an_online_run_killed_after_several_in_place_switches_retrains_every_stage_since_its_start(
    tmp_path, killed_stage
):
    run = online_run(tmp_path)
    switches = {1: (3, 16), 2: (6, 4), 3: (8, 32)}  # the gbs and iterations of the chain above
    with pytest.raises(Killed):
        run_online(run, launcher=MemoryEngine(killed_stage, switches), out=lambda line: None)
    engine = MemoryEngine(switches=switches)
    state = run_online(run, launcher=engine, out=lambda line: None)

    replays = engine.specs[: killed_stage - 1]
    starts = [0, 3, 6, 8, 10]
    assert [(spec.stage, spec.continue_in_place, spec.target_iteration) for spec in replays] == [
        (n, n > 1, starts[n]) for n in range(1, killed_stage)
    ]
    assert all(spec.retraining for spec in replays)
    last = state.stages[-1]
    assert [stage.status for stage in state.stages] == ["done"] * 4
    assert (last.last_iteration, last.consumed_samples) == (10, 144)
    assert json.loads((Path(last.checkpoint) / "windows.json").read_text()) == [list(w) for w in WINDOWS]
