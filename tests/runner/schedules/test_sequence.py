"""Stage sequencing and resume, with a fake engine (chain_fakes.FakeEngine) in place of the workers."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
from pathlib import Path

import numpy as np
import pytest
from tests.helpers.chain_fakes import (
    KILL_POINTS,
    FakeEngine,
    chain_run,
    run_layout,
    run_until_killed,
    seed_shaped_chain,
    setup_run,
    tiny_layout,
)

from cona.commands.train_runs import chain_run as chain_run_from_args
from cona.data.indexed import IndexedDatasetWriter
from cona.errors import ChainError, CheckpointError, LaunchError, TrainingDiverged, UsageError
from cona.runner.publish import LATEST_UNIVERSAL
from cona.runner.schedules.chain_schedule import run_chain
from cona.runner.state import load_state

ITERS = 3
FINAL_SAMPLES = ITERS * (8 + 16 + 32)


def run(workdir: Path, engine: FakeEngine, *, fresh: bool = False) -> tuple[list[str], object]:
    lines: list[str] = []
    state = run_chain(
        chain_run(workdir, workdir / "chain.json", fresh=fresh), launcher=engine, out=lines.append
    )
    return lines, state


def stage_books(state) -> list[tuple]:
    return [
        (s.status, s.start_iteration, s.target_iteration, s.consumed_samples, s.consumed_tokens)
        for s in state.stages
    ]


def test_chain_hands_each_stage_the_previous_checkpoint(tmp_path):
    setup_run(tmp_path)
    engine = FakeEngine()
    lines, state = run(tmp_path, engine)
    assert lines[0].startswith("starting run run: 3 stages")
    assert stage_books(state) == [("done", 0, 3, 24, 192), ("done", 3, 6, 72, 576), ("done", 6, 9, 168, 1344)]
    specs = [launch.spec for launch in engine.launches]
    layout1, layout2 = tmp_path / run_layout(1, 2, 2), tmp_path / run_layout(1, 1, 4)
    assert [spec.load_path for spec in specs] == [
        None,
        layout1 / "global_step3_universal",
        layout2 / "global_step6_universal",
    ]
    assert [spec.target_iteration for spec in specs] == [3, 6, 9]
    assert [spec.lr_factor for spec in specs] == pytest.approx(
        [1.0, math.sqrt(2), 2.0]
    )  # sqrt rule, base_gbs 8
    assert {spec.planned_tokens for spec in specs} == {FINAL_SAMPLES * 8}
    assert [launch.topology.master_port for launch in engine.launches] == [29401, 29402, 29403]
    assert [launch.topology.nproc_per_node for launch in engine.launches] == [4, 4, 4]
    # stage 1's copy stays (keep-latest); delete-all after stage 3 removed stage 2's copy in the shared layout
    assert (layout1 / LATEST_UNIVERSAL).is_file() and (layout1 / "global_step3_universal").is_dir()
    assert not (layout2 / "global_step6_universal").exists() and not (layout2 / LATEST_UNIVERSAL).exists()
    assert state.stage(3).pruned == (str(layout2 / "global_step6_universal"),)
    assert set(state.stage(2).switch_cost) == {
        "save_s",
        "publish_s",
        "process_start_s",
        "load_s",
        "first_step_s",
    }
    assert any(line.startswith("switch 1->2: save ") for line in lines)
    assert (
        lines[-1] == f"run run finished: 3 stages, iteration 9, consumed_samples={FINAL_SAMPLES}, "
        f"consumed_tokens={FINAL_SAMPLES * 8}"
    )


def test_rerun_of_a_finished_chain_does_nothing_and_fresh_starts_over(tmp_path):
    setup_run(tmp_path)
    engine = FakeEngine()
    run(tmp_path, engine)
    lines, _ = run(tmp_path, engine)
    assert len(engine.launches) == 3
    assert lines == [
        f"run run already finished at iteration 9, consumed_samples={FINAL_SAMPLES}; nothing to do "
        f"(--fresh starts it over)"
    ]
    lines, state = run(tmp_path, engine, fresh=True)
    assert lines[0].startswith("starting run") and len(engine.launches) == 6
    assert engine.launches[3].spec.load_path is None and state.stage(3).consumed_samples == FINAL_SAMPLES


def test_run_directory_of_another_chain_or_config_is_refused(tmp_path):
    setup_run(tmp_path)
    run(tmp_path, FakeEngine())
    (tmp_path / "chain.json").write_text(json.dumps(seed_shaped_chain(ITERS + 1)))
    with pytest.raises(ChainError, match="step 1 of .*chain.json changed after it ran; only steps not yet"):
        run(tmp_path, FakeEngine())
    (tmp_path / "chain.json").write_text(json.dumps(seed_shaped_chain(ITERS)))
    config = json.loads((tmp_path / ".conaconfig").read_text())
    config["training"]["base_lr"] = 5e-4
    (tmp_path / ".conaconfig").write_text(json.dumps(config))
    with pytest.raises(ChainError, match="was made for a different .conaconfig"):
        run(tmp_path, FakeEngine())


def test_the_same_chain_into_another_workdir_is_refused_instead_of_finished(tmp_path):
    setup_run(tmp_path)
    run(tmp_path, FakeEngine())
    moved = dataclasses.replace(chain_run(tmp_path, tmp_path / "chain.json"), workdir=tmp_path / "other")
    with pytest.raises(ChainError, match=r"was made for --workdir .*; pass --fresh to start it over"):
        run_chain(moved, launcher=FakeEngine(), out=lambda line: None)


def test_a_chain_edited_after_a_crash_continues_with_the_steps_not_yet_started_as_edited(tmp_path):
    chain_path = setup_run(tmp_path)
    wait_status = run_until_killed(tmp_path, chain_path, "training")  # in stage 2, after its checkpoint at 4
    assert os.WIFSIGNALED(wait_status) and os.WTERMSIG(wait_status) == signal.SIGKILL, wait_status
    chain = seed_shaped_chain(ITERS)
    edited_running = json.loads(json.dumps(chain))
    edited_running["steps"][1]["extra_iters"] = ITERS + 2
    chain_path.write_text(json.dumps(edited_running))
    with pytest.raises(ChainError, match="step 2 of .*chain.json changed after it started; only steps not"):
        run(tmp_path, FakeEngine())
    chain["steps"][2]["target_iters"] = 3 * ITERS + 2  # stage 3 has not started: it may change
    added = {key: value for key, value in chain["steps"][2].items() if key != "target_iters"}
    chain["steps"].append({**added, "step_num": 4, "extra_iters": 1})  # and a step may be added
    chain_path.write_text(json.dumps(chain))
    engine = FakeEngine()
    lines, state = run(tmp_path, engine)
    assert lines[0].startswith("resuming run run at stage 2 (running)")
    assert lines[0].endswith("edited after step 2 started: steps 3..4 as the file now says")
    assert engine.launches[0].spec.load_path == tmp_path / run_layout(1, 1, 4) / "global_step4"
    assert [spec.target_iteration for spec in (launch.spec for launch in engine.launches)] == [6, 11, 12]
    assert [stage.status for stage in state.stages] == ["done"] * 4
    assert state.stages[-1].consumed_samples == 3 * 8 + 3 * 16 + 5 * 32 + 1 * 32
    lines, _ = run(tmp_path, FakeEngine())
    assert lines[0].startswith("run run already finished at iteration 12")


def test_a_first_step_continues_from_a_given_checkpoint_of_another_run(tmp_path):
    (tmp_path / "first").mkdir()
    setup_run(tmp_path / "first")
    run(tmp_path / "first", FakeEngine())
    given = tmp_path / "first" / run_layout(1, 1, 4) / "global_step9"
    step = {**seed_shaped_chain(ITERS)["steps"][2], "is_initial": True, "load_checkpoint": str(given)}
    del step["target_iters"], step["load_dp"], step["load_tp"], step["load_pp"]
    setup_run(tmp_path, {"steps": [{**step, "step_num": 1, "extra_iters": 2}]})
    engine = FakeEngine()
    lines, state = run(tmp_path, engine)
    (launch,) = engine.launches
    assert launch.spec.load_path == given and launch.spec.target_iteration == 11
    assert launch.spec.planned_tokens == (FINAL_SAMPLES + 2 * 32) * 8  # the horizon counts the given tokens
    assert any("iterations 9->11" in line and f"load {given}" in line for line in lines), lines
    assert stage_books(state) == [("done", 9, 11, FINAL_SAMPLES + 64, (FINAL_SAMPLES + 64) * 8)]


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"load_checkpoint": "nowhere"}, "step 1: load_checkpoint: checkpoint .*nowhere does not exist"),
        ({"load_checkpoint": 3}, r"steps\[0\] \(step_num 1\): load_checkpoint: expected a path"),
        ({"load_checkpoint": f"given/{run_layout(1, 2, 2)}"}, "train_iters: 3 is not past the iteration"),
    ],
)
def test_a_given_checkpoint_is_refused_in_one_line(tmp_path, change, expected):
    (tmp_path / "given").mkdir()
    setup_run(tmp_path / "given")
    run(tmp_path / "given", FakeEngine())  # its first layout's latest: global_step3
    chain = seed_shaped_chain(ITERS)
    chain["steps"][0].update(change)
    setup_run(tmp_path, chain)
    with pytest.raises(ChainError, match=expected):
        run(tmp_path, FakeEngine())


def test_only_the_first_step_loads_a_given_checkpoint(tmp_path):
    chain = seed_shaped_chain(ITERS)
    chain["steps"][1]["load_checkpoint"] = "x"
    setup_run(tmp_path, chain)
    with pytest.raises(ChainError, match="step 2: load_checkpoint: only the initial step loads a given"):
        run(tmp_path, FakeEngine())


def test_a_stage_that_stops_short_is_an_error(tmp_path):
    setup_run(tmp_path)

    class StopsEarly(FakeEngine):
        def __call__(self, launch):
            super().__call__(launch)
            result = json.loads(launch.spec.result_path.read_text())
            launch.spec.result_path.write_text(
                json.dumps({**result, "reason": "switch_requested", "last_iteration": 2})
            )

    with pytest.raises(
        LaunchError,
        match=r"stage 1 stopped at iteration 2 \(switch_requested\) instead of its "
        r"target 3",
    ):
        run(tmp_path, StopsEarly())
    assert load_state(tmp_path / "logs" / "run").stage(1).status == "running"


def test_a_stage_that_stopped_diverged_is_not_resumed_unless_asked(tmp_path):
    """The same command after a divergence would train on from the newest checkpoint into it again: it is
    refused, naming the divergence and --resume-diverged, which resumes it."""
    setup_run(tmp_path)

    class DivergesOnce(FakeEngine):
        def __call__(self, launch):
            if not self.launches:
                self.launches.append(launch)
                error = {"rank": 0, "time": 1.0, "type": "TrainingDiverged", "message": "loss 85"}
                (launch.spec.stage_dir / "rank0.error").write_text(json.dumps(error))
                raise LaunchError("stage 1: rank 0 failed: TrainingDiverged: loss 85")
            super().__call__(launch)

    engine = DivergesOnce()
    with pytest.raises(LaunchError):
        run(tmp_path, engine)
    with pytest.raises(TrainingDiverged, match=r"^stage 1 stopped diverged \(loss 85\); .*--resume-diverged"):
        run(tmp_path, engine)
    assert len(engine.launches) == 1
    resumed = dataclasses.replace(chain_run(tmp_path, tmp_path / "chain.json"), resume_diverged=True)
    state = run_chain(resumed, launcher=engine, out=lambda line: None)
    assert state.current is None and len(engine.launches) == 4


def test_options_from_the_command_line(tmp_path):
    setup_run(tmp_path)
    config = json.loads((tmp_path / ".conaconfig").read_text())
    config["training"]["data_prefix"] = "data"
    (tmp_path / ".conaconfig").write_text(json.dumps(config))
    with IndexedDatasetWriter(tmp_path / "data", np.uint16) as writer:  # checked before the run starts
        for start in range(0, 2000, 50):
            writer.add_document(np.arange(start, start + 50) % 64)
    args = argparse.Namespace(
        chain=str(tmp_path / "chain.json"),
        config=str(tmp_path / ".conaconfig"),
        workdir=tmp_path,
        gpus=4,
        fresh=True,
        resume_diverged=True,
        device="cpu",
    )
    options = chain_run_from_args(args)
    assert (options.world_size, options.device_type, options.fresh) == (4, "cpu", True)
    assert options.resume_diverged
    # one node without --master-port-base: torchrun picks a free port for every stage
    assert options.run_dir == tmp_path / "logs" / "chain-chain" and options.base_port is None
    explicit = chain_run_from_args(argparse.Namespace(**{**vars(args), "master_port_base": 29400}))
    assert explicit.base_port == 29400
    assert (
        chain_run_from_args(
            argparse.Namespace(**{**vars(args), "gpus": None, "num_nodes": 1, "gpus_per_node": 4})
        ).world_size
        == 4
    )
    # The original CONA command line, no --gpus: on CPU the chain's first step says how many processes
    # (dp * tp * pp).
    first = json.loads((tmp_path / "chain.json").read_text())["steps"][0]
    seed_form = chain_run_from_args(argparse.Namespace(**{**vars(args), "gpus": None}))
    assert seed_form.world_size == first.get("dp", 1) * first.get("tp", 1) * first.get("pp", 1)
    (tmp_path / "chain.json").write_text("{}")
    with pytest.raises(UsageError, match="pass --gpus N"):
        chain_run_from_args(argparse.Namespace(**{**vars(args), "gpus": None}))
    with pytest.raises(LaunchError, match="--gpus is the process count of one node"):
        chain_run_from_args(argparse.Namespace(**{**vars(args), "num_nodes": 3, "gpus_per_node": 4}))


def test_a_marker_moved_by_someone_else_is_refused(tmp_path):
    chain_path = setup_run(tmp_path)
    run_until_killed(tmp_path, chain_path, "between_stages")
    layout = tmp_path / run_layout(1, 2, 2)
    (layout / "global_step99_universal").mkdir()
    (layout / LATEST_UNIVERSAL).write_text("global_step99_universal")
    with pytest.raises(ChainError, match="names global_step99_universal, not global_step3_universal"):
        run(tmp_path, FakeEngine())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[tuple]:
    workdir = tmp_path_factory.mktemp("uninterrupted")
    setup_run(workdir)
    return stage_books(run(workdir, FakeEngine())[1])


@pytest.mark.parametrize("kill_point", KILL_POINTS)
def test_sigkill_then_rerun_finishes_with_the_same_books(tmp_path, kill_point, uninterrupted):
    chain_path = setup_run(tmp_path)
    wait_status = run_until_killed(tmp_path, chain_path, kill_point)
    assert os.WIFSIGNALED(wait_status) and os.WTERMSIG(wait_status) == signal.SIGKILL, wait_status
    before = load_state(tmp_path / "logs" / "run")
    engine = FakeEngine()
    lines, state = run(tmp_path, engine)
    current = before.current
    assert lines[0].startswith(f"resuming run run at stage {current.step_num} ({current.status})")
    assert "consumed_samples=" in lines[0]
    assert stage_books(state) == uninterrupted
    assert state.stages[-1].consumed_samples == FINAL_SAMPLES
    if kill_point == "training":  # relaunched from the checkpoint the stage saved before it died
        assert engine.launches[0].spec.load_path == tmp_path / run_layout(1, 1, 4) / "global_step4"
        assert "iteration=4, consumed_samples=40" in lines[0]
    leftovers = [
        p.name for p in (tmp_path / "checkpoints").rglob("*") if p.name.endswith((".tmp", ".deleting"))
    ]
    assert leftovers == []


def checkpoint_times(layouts: Path) -> dict[Path, float]:
    return {path: path.stat().st_mtime for path in layouts.rglob("global_step*")}


def test_two_runs_in_one_workdir_keep_their_checkpoints(tmp_path):
    setup_run(tmp_path)
    _, first_state = run(tmp_path, FakeEngine())
    first = checkpoint_times(tmp_path / "checkpoints" / "run")
    other = dataclasses.replace(
        chain_run(tmp_path, tmp_path / "chain.json"), run_dir=tmp_path / "logs" / "other"
    )
    other_state = run_chain(other, launcher=FakeEngine(), out=lambda line: None)
    assert checkpoint_times(tmp_path / "checkpoints" / "run") == first  # the first run's, untouched
    for state, name in ((first_state, "run"), (other_state, "other")):
        assert [stage.checkpoint for stage in state.stages] == [
            str(tmp_path / run_layout(1, 2, 2, name) / "global_step3"),
            str(tmp_path / run_layout(1, 1, 4, name) / "global_step6"),
            str(tmp_path / run_layout(1, 1, 4, name) / "global_step9"),
        ]
    lines, _ = run(tmp_path, FakeEngine())  # each run still finds its own state and checkpoints
    assert lines[0].startswith("run run already finished at iteration 9")


def test_a_run_of_the_same_name_under_another_log_root_never_replaces_the_first_one_s_checkpoints(tmp_path):
    setup_run(tmp_path)
    run(tmp_path, FakeEngine())
    first = checkpoint_times(tmp_path / "checkpoints")
    other = dataclasses.replace(
        chain_run(tmp_path, tmp_path / "chain.json"), run_dir=tmp_path / "other_logs" / "run"
    )
    with pytest.raises(CheckpointError, match=r"stage 1: .*global_step3 is another run's checkpoint"):
        run_chain(other, launcher=FakeEngine(), out=lambda line: None)
    assert checkpoint_times(tmp_path / "checkpoints") == first


def as_an_older_version_left_it(workdir: Path) -> None:
    """Move run ``run``'s checkpoints where versions without the run in the path kept them
    (``checkpoints/tiny/...``), and what its run directory recorded of them with them."""
    os.replace(workdir / "checkpoints" / "run" / "tiny", workdir / "checkpoints" / "tiny")
    run_dir = workdir / "logs" / "run"
    for record in (run_dir / "runner_state.json", *run_dir.glob("stages/*/stage_result.json")):
        text = record.read_text().replace(str(workdir / "checkpoints" / "run"), str(workdir / "checkpoints"))
        record.write_text(text)


@pytest.mark.parametrize("kill_point", KILL_POINTS)
def test_a_run_an_older_version_started_resumes_from_its_checkpoints_at_the_old_path(
    tmp_path, kill_point, uninterrupted
):
    chain_path = setup_run(tmp_path)
    run_until_killed(tmp_path, chain_path, kill_point)
    as_an_older_version_left_it(tmp_path)
    before = load_state(tmp_path / "logs" / "run")
    engine = FakeEngine()
    lines, state = run(tmp_path, engine)
    assert stage_books(state) == uninterrupted
    for earlier, stage in zip(before.stages, state.stages, strict=True):  # trained since: at the new path
        folder = (
            "checkpoints/tiny" if earlier.status not in ("pending", "running") else "checkpoints/run/tiny"
        )
        assert Path(stage.checkpoint).is_relative_to(tmp_path / folder), (stage.step_num, stage.checkpoint)
    if kill_point == "training":  # stage 2 saved iteration 4 at the old path, then died
        old = tmp_path / tiny_layout(1, 1, 4) / "global_step4"
        assert lines[0].startswith(f"resuming run run at stage 2 (running) from {old}, iteration=4")
        assert engine.launches[0].spec.load_path == old


def test_an_older_cona_s_checkpoint_of_another_run_is_not_resumed_from(tmp_path):
    chain_path = setup_run(tmp_path)
    run_until_killed(tmp_path, chain_path, "training")
    old_layout = tmp_path / tiny_layout(1, 1, 4)
    old_layout.parent.mkdir(parents=True)
    os.replace(tmp_path / run_layout(1, 1, 4), old_layout)
    trainer_state = old_layout / "global_step4" / "trainer_state.json"
    raw = json.loads(trainer_state.read_text())
    raw["run"] = "0123456789ab"  # another run's save: the stage relaunches from what it loaded first
    trainer_state.write_text(json.dumps(raw))
    engine = FakeEngine()
    run(tmp_path, engine)
    assert engine.launches[0].spec.load_path == tmp_path / run_layout(1, 2, 2) / "global_step3_universal"
