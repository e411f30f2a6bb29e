"""Before a stage starts, the checkpoint it loads is cross-checked against the run state: a trainer state
changed after the save (consumed samples set back, which would train samples twice) is refused naming the
file, even when the checkpoint's manifest was rewritten to match it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from tests.helpers.ckpt_tamper import rewrite_manifest
from tests.helpers.small_checkpoint import ONE, small_config, trained

from cona.engine.checkpoint.paths import layout_dir
from cona.engine.checkpoint.save import save_checkpoint
from cona.engine.spec import StageSpec
from cona.errors import CheckpointError
from cona.runner.launch import Topology
from cona.runner.stage_run import StageLaunch, launch_stage
from cona.runner.state import advance, new_state, save_state

BOOKS = {"iteration": 40, "consumed_samples": 320, "consumed_tokens": 2560}


@pytest.fixture
def recorded(tmp_path: Path):
    """A run whose stage 1 finished with a checkpoint at ``BOOKS``, and stage 2's launch that loads it."""
    config = small_config()
    model, optimizer = trained(config)
    checkpoint = save_checkpoint(
        layout_dir(tmp_path / "work", config, ONE, "fp32", run_name="run"),
        iteration=BOOKS["iteration"],
        model_parts=[model],
        optimizer=optimizer,
        trainer_state={**BOOKS, "stage": 1},
        config=config,
        strategy=ONE,
    )
    run_dir = tmp_path / "run"
    state = new_state(chain_path="c.json", chain_digest="a", config_digest="b", world_size=1, num_stages=2)
    stage = advance(state.stage(1), "done", checkpoint=str(checkpoint), last_iteration=BOOKS["iteration"])
    stage = dataclasses.replace(
        stage, consumed_samples=BOOKS["consumed_samples"], consumed_tokens=BOOKS["consumed_tokens"]
    )
    run_dir.mkdir()
    save_state(run_dir, state.with_stage(stage))
    spec = StageSpec(
        run_dir=run_dir,
        config=config,
        strategy=ONE,
        stage=2,
        workdir=tmp_path / "work",
        planned_tokens=10_000,
        load_path=checkpoint.parent,  # through the layout's latest marker
        target_iteration=80,
    )
    launch = StageLaunch(
        spec=spec,
        spec_path=run_dir / "spec.json",
        topology=Topology(nproc_per_node=1, master_port=29500),
        device_type="cpu",
    )
    return checkpoint, launch


def test_a_checkpoint_that_matches_the_run_state_is_launched(recorded) -> None:
    _, launch = recorded
    launched: list[StageLaunch] = []
    launch_stage(launched.append, launch)
    assert launched == [launch]


def test_consumed_samples_set_back_after_the_save_is_refused_before_the_launch(recorded) -> None:
    checkpoint, launch = recorded
    trainer_state = checkpoint / "trainer_state.json"
    trainer_state.write_text(json.dumps({**json.loads(trainer_state.read_text()), "consumed_samples": 0}))
    rewrite_manifest(checkpoint)  # consistent checksums: only the run state tells
    launched: list[StageLaunch] = []
    with pytest.raises(CheckpointError) as refused:
        launch_stage(launched.append, launch)
    assert str(refused.value) == (
        f"{trainer_state}: consumed_samples is 0, but the run state {launch.spec.run_dir}/runner_state.json "
        "records 320 for stage 1's checkpoint; refusing it"
    )
    assert launched == []


def test_a_checkpoint_the_run_state_does_not_record_is_left_to_the_workers(recorded, tmp_path) -> None:
    _, launch = recorded
    config = small_config()
    model, optimizer = trained(config, steps=1)
    other = save_checkpoint(
        tmp_path / "elsewhere",
        iteration=3,
        model_parts=[model],
        optimizer=optimizer,
        trainer_state={"iteration": 3, "consumed_samples": 0},
        config=config,
        strategy=ONE,
    )
    launched: list[StageLaunch] = []
    launch_stage(
        launched.append, dataclasses.replace(launch, spec=dataclasses.replace(launch.spec, load_path=other))
    )
    assert len(launched) == 1
