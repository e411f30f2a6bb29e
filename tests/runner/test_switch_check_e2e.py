"""Switch verification on real stages: the tiny GPT on 2 CPU processes (torchrun, gloo) through the chain
runner, switching tp2 -> pp2 -> dp2.

An intact chain passes the check at every switch (the probe losses saved and loaded agree within the
dtype's tolerance). A chain whose first checkpoint is damaged between the stages (the rows of one tp shard
of a weight reversed in place, as a resharding bug would leave them, with checksums that match) is refused
before stage 2 trains: the runner stops with one message naming the checkpoint, both layouts and both
losses, the damaged checkpoint stays published byte for byte, and rerunning the command refuses it again.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import re
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from tests.helpers.ckpt_tamper import rewrite_manifest
from tests.helpers.tiny import MARKOV_VOCAB as MARKOV_VOCAB
from tests.helpers.tiny import write_tiny_config
from tests.helpers.tiny_runs import chain_args, write_chain
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from cona.commands import train_runs
from cona.engine.checkpoint.info import LATEST_UNIVERSAL, PROBE_FILE
from cona.engine.spec import StageResult
from cona.engine.switch_check import PROBE_RTOL, Verdict
from cona.errors import CheckpointError, LaunchError
from cona.runner.schedules.chain_schedule import run_chain
from cona.runner.stage_run import StageLaunch, torchrun_launcher
from cona.runner.state import load_state
from cona.runner.worker_session import WorkerSession

STRATEGIES = ((1, 2, 1), (1, 1, 2), (2, 1, 1))
"""(dp, tp, pp) of the chain's stages: every switch changes the layout."""
ITERATIONS = (3, 2, 2)


@pytest.fixture(scope="module")
def setup_dir(tmp_path_factory) -> Path:
    """The tiny config and its data, and the chain file."""
    directory = tmp_path_factory.mktemp("switch_check")
    write_tiny_config(directory, data="markov")
    steps = []
    for number, ((dp, tp, pp), iters) in enumerate(zip(STRATEGIES, ITERATIONS, strict=True), start=1):
        step = {"dp": dp, "tp": tp, "pp": pp, "gbs": 8, "mbs": 4, "convert": number < len(STRATEGIES)}
        steps.append(
            step | ({"train_iters": iters, "is_initial": True} if number == 1 else {"extra_iters": iters})
        )
    write_chain(directory / "chain.json", steps)
    return directory


def args_of(directory: Path, workdir: Path, run_name: str) -> argparse.Namespace:
    return chain_args(
        directory / ".conaconfig", directory / "chain.json", workdir, run_name, stages=len(STRATEGIES)
    )


def reverse_rows_of_one_tp_shard(checkpoint: Path) -> str:
    """Reverse, in place in its shard file, the rows of the last shard of the largest model tensor that is
    stored in several shards; returns the tensor's name. The file keeps its length and inode (so the
    hard-linked universal copy shows the damage too), and the DCP metadata still describes it."""
    metadata = dcp.FileSystemReader(checkpoint).read_metadata()
    sharded = {
        fqn: entry
        for fqn, entry in metadata.state_dict_metadata.items()
        if fqn.startswith("model.") and isinstance(entry, TensorStorageMetadata) and len(entry.chunks) > 1
    }
    fqn, entry = max(sharded.items(), key=lambda item: torch.Size(item[1].size).numel())
    offsets = tuple(entry.chunks[-1].offsets)
    info = next(
        info
        for index, info in metadata.storage_data.items()
        if index.fqn == fqn and tuple(index.offset) == offsets
    )
    with open(checkpoint / info.relative_path, "r+b") as handle:
        handle.seek(info.offset)
        shard = torch.load(io.BytesIO(handle.read(info.length)), weights_only=True)
        shard.copy_(shard.flip(0))  # in place: the saved storage keeps its size
        rewritten = io.BytesIO()
        torch.save(shard, rewritten)
        assert len(rewritten.getvalue()) == info.length
        handle.seek(info.offset)
        handle.write(rewritten.getvalue())
    return fqn


def file_digests(directory: Path) -> dict[str, str]:
    return {
        str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


@pytest.mark.slow
@pytest.mark.multiproc
def test_an_intact_chain_passes_the_check_at_every_switch(setup_dir, tmp_path):
    lines: list[str] = []
    with WorkerSession() as session:  # as `cona train --chain` runs it: one process start for the 3 stages
        state = run_chain(
            train_runs.chain_run(args_of(setup_dir, tmp_path, "intact")), launcher=session, out=lines.append
        )

    assert [stage.status for stage in state.stages] == ["done"] * len(STRATEGIES)
    assert state.stages[0].switch_check is None  # stage 1 starts from scratch
    for previous, stage in zip(state.stages, state.stages[1:], strict=False):
        verdict = Verdict.from_dict(stage.switch_check)
        assert verdict.status == "passed", verdict.message()
        assert verdict.saved is not None and verdict.loaded is not None
        # The loss saved is the one in the previous stage's checkpoint, measured at its last iteration.
        saved = json.loads((Path(previous.checkpoint) / PROBE_FILE).read_text())
        assert saved["loss"] == verdict.saved.loss and saved["iteration"] == previous.last_iteration
        assert verdict.saved.layout != verdict.loaded.layout
        assert abs(verdict.loaded.loss - verdict.saved.loss) <= PROBE_RTOL["fp32"] * verdict.saved.loss
        assert verdict.saved.loss < 0.99 * torch.log(torch.tensor(float(MARKOV_VOCAB))).item()  # it trained
        # Its cost is on the books of the switch.
        assert {"probe_s", "verify_s"} <= stage.switch_cost.keys()
        assert all(stage.switch_cost[key] >= 0 for key in ("probe_s", "verify_s"))
        assert any(line.startswith(f"stage {stage.step_num}: switch check passed") for line in lines)


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_damaged_shard_is_refused_before_the_next_stage_trains(setup_dir, tmp_path):
    damaged: dict[str, object] = {}

    def damage_after_stage_1(launch: StageLaunch) -> None:
        torchrun_launcher(launch)
        if launch.spec.stage == 1:
            checkpoint = Path(StageResult.read(launch.spec.result_path).checkpoint)
            damaged["tensor"] = reverse_rows_of_one_tp_shard(checkpoint)
            rewrite_manifest(checkpoint)  # as a resharding bug would save it: checksums of the wrong rows
            damaged["checkpoint"], damaged["digests"] = checkpoint, file_digests(checkpoint)

    args = args_of(setup_dir, tmp_path, "damaged")
    with pytest.raises(CheckpointError) as refused:
        run_chain(train_runs.chain_run(args), launcher=damage_after_stage_1, out=lambda line: None)
    checkpoint = damaged["checkpoint"]
    assert isinstance(checkpoint, Path)
    universal = checkpoint.parent / f"{checkpoint.name}_universal"
    message = str(refused.value)
    assert message.startswith(f"stage 2: switch verification refused checkpoint {universal}: probe loss ")
    assert "saved under dp1/tp2/pp1 mbs4 gbs8" in message
    assert "after loading under dp1/tp1/pp2 mbs4 gbs8" in message
    assert "\n" not in message

    run_dir = Path(setup_dir, "logs", "damaged")
    verdict = Verdict.from_dict(json.loads((run_dir / "stages/2/switch_check.json").read_text()))
    assert verdict.status == "failed" and verdict.difference > verdict.tolerance
    assert f"{verdict.saved.loss:.8g}" in message and f"{verdict.loaded.loss:.8g}" in message
    assert f"differ by {verdict.difference:.6g}" in message

    # Nothing moved: stage 1 stays done and published as damaged, stage 2 trained and saved nothing.
    assert file_digests(universal) == file_digests(checkpoint) == damaged["digests"]
    state = load_state(run_dir)
    assert [stage.status for stage in state.stages] == ["done", "running", "pending"]
    assert state.stages[0].universal == str(universal)
    assert (checkpoint.parent / LATEST_UNIVERSAL).read_text().strip() == universal.name
    assert not any(json.loads(line)["stage"] == 2 for line in (run_dir / "metrics.jsonl").open())
    stage2_layout = Path(tmp_path, "checkpoints", "damaged", "gpt-tiny", "z1", "fp32", "tp1_pp2_dp1_sp1")
    assert not list(stage2_layout.glob("global_step*"))

    # The same command again refuses again, and leaves the checkpoint as it was.
    with pytest.raises(CheckpointError, match="stage 2: switch verification refused"):
        run_chain(train_runs.chain_run(args), out=lambda line: None)
    assert file_digests(universal) == damaged["digests"]
    assert [stage.status for stage in load_state(run_dir).stages] == ["done", "running", "pending"]


@pytest.mark.slow
@pytest.mark.multiproc
def test_flipped_bytes_are_refused_by_the_workers_checksums_naming_the_file(setup_dir, tmp_path):
    """The same damage without matching checksums: both ranks of stage 2 verify the manifest (each hashing a
    share), refuse before loading, and the run stops with one line naming the shard file."""
    damaged: dict[str, Path] = {}

    def damage_after_stage_1(launch: StageLaunch) -> None:
        torchrun_launcher(launch)
        if launch.spec.stage == 1:
            damaged["checkpoint"] = Path(StageResult.read(launch.spec.result_path).checkpoint)
            reverse_rows_of_one_tp_shard(damaged["checkpoint"])

    with pytest.raises(LaunchError) as refused:
        run_chain(
            train_runs.chain_run(args_of(setup_dir, tmp_path, "flipped")),
            launcher=damage_after_stage_1,
            out=lambda line: None,
        )
    message = str(refused.value)
    universal = damaged["checkpoint"].parent / f"{damaged['checkpoint'].name}_universal"
    shard = rf"{universal}/__\d+_\d+\.distcp"  # every rank refuses with the same line
    refusal = rf"{shard}: corrupt: its SHA-256 is not the one in manifest\.json; refusing the checkpoint"
    assert re.match(rf"stage 2: rank [01] failed: CheckpointError: {refusal} \(traceback: ", message)
    assert "\n" not in message
