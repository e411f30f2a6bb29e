"""Publishing a checkpoint as universal (hard links, marker last) and pruning universal copies."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.helpers.chain_fakes import (
    LAYOUT,
    FakeEngine,
    chain_run,
    make_checkpoint,
    seed_shaped_chain,
    write_fake_chain_config,
)

from cona.engine.checkpoint.info import resolve_checkpoint
from cona.engine.checkpoint.load import load_model_tensors
from cona.errors import CheckpointError
from cona.runner import publish as publish_module
from cona.runner.chain_file import PruneRule
from cona.runner.publish import LATEST_UNIVERSAL, prune, publish
from cona.runner.schedules.chain_schedule import run_chain


def files_of(directory: Path) -> list[str]:
    return sorted(str(path.relative_to(directory)) for path in directory.rglob("*") if path.is_file())


def test_publish_links_every_file_and_writes_the_marker(tmp_path):
    checkpoint = make_checkpoint(tmp_path, 5)
    universal = publish(checkpoint)
    assert universal == checkpoint.parent / "global_step5_universal"
    assert files_of(universal) == files_of(checkpoint) and ".metadata" in files_of(universal)
    for name in files_of(checkpoint):
        assert os.path.samefile(checkpoint / name, universal / name)  # hard links: no byte duplicated
    assert (checkpoint.parent / LATEST_UNIVERSAL).read_text() == "global_step5_universal"
    assert resolve_checkpoint(checkpoint.parent / LATEST_UNIVERSAL) == universal
    assert torch.equal(load_model_tensors(universal)["weight"], torch.full((2, 3), 5.0))


def test_universal_copy_survives_deleting_the_original(tmp_path):
    checkpoint = make_checkpoint(tmp_path, 3)
    universal = publish(checkpoint)
    shutil.rmtree(checkpoint)
    assert torch.equal(load_model_tensors(universal)["weight"], torch.full((2, 3), 3.0))


@pytest.mark.parametrize("damage", ["truncate a shard", "drop the metadata"])
def test_incomplete_checkpoint_is_not_published(tmp_path, damage):
    checkpoint = make_checkpoint(tmp_path, 2)
    if damage == "truncate a shard":
        shard = next(checkpoint.glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[:10])
    else:
        (checkpoint / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=str(checkpoint)):
        publish(checkpoint)
    assert not (checkpoint.parent / "global_step2_universal").exists()
    assert not (checkpoint.parent / LATEST_UNIVERSAL).exists()


def test_publish_finishes_what_a_killed_publish_left(tmp_path):
    checkpoint = make_checkpoint(tmp_path, 4)
    half_built = checkpoint.parent / "global_step4_universal.tmp"
    half_built.mkdir()
    (half_built / ".metadata").write_text("half")
    universal = publish(checkpoint)
    assert not half_built.exists() and files_of(universal) == files_of(checkpoint)
    (checkpoint.parent / LATEST_UNIVERSAL).unlink()  # killed after the rename, before the marker
    assert publish(checkpoint) == universal
    assert (checkpoint.parent / LATEST_UNIVERSAL).read_text() == universal.name


def test_publish_replaces_a_stale_copy_of_an_earlier_run(tmp_path):
    old = publish(make_checkpoint(tmp_path, 6))
    checkpoint = make_checkpoint(tmp_path, 6)  # saved again: new files under the same name
    assert not os.path.samefile(checkpoint / ".metadata", old / ".metadata")
    universal = publish(checkpoint)
    assert os.path.samefile(checkpoint / ".metadata", universal / ".metadata")


def test_copies_with_a_warning_where_hard_links_are_impossible(tmp_path, monkeypatch, caplog):
    checkpoint = make_checkpoint(tmp_path, 1)

    def no_links(source, target):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(publish_module.os, "link", no_links)
    with caplog.at_level(logging.WARNING, logger="cona.runner.publish"):
        universal = publish(checkpoint)
    assert "copying it instead" in caplog.text
    assert not os.path.samefile(checkpoint / ".metadata", universal / ".metadata")
    assert torch.equal(load_model_tensors(universal)["weight"], torch.full((2, 3), 1.0))


def publish_three(workdir: Path) -> Path:
    for iteration in (1, 2, 3):
        publish(make_checkpoint(workdir, iteration))
    return workdir / LAYOUT


def universal_dirs(layout: Path) -> list[str]:
    return sorted(path.name for path in layout.iterdir() if "_universal" in path.name and path.is_dir())


def test_keep_latest_keeps_only_what_the_marker_names(tmp_path):
    layout = publish_three(tmp_path)
    result = prune(PruneRule(stage=1, ckpt_dir=LAYOUT, mode="keep-latest"), layout)
    assert result.removed == ("global_step1_universal", "global_step2_universal")
    assert universal_dirs(layout) == ["global_step3_universal"]
    assert (layout / "global_step1").is_dir() and (layout / "global_step2").is_dir()  # originals untouched
    assert resolve_checkpoint(layout / LATEST_UNIVERSAL) == layout / "global_step3_universal"
    again = prune(PruneRule(stage=1, ckpt_dir=str(layout), mode="keep-latest"), layout)
    assert again.removed == () and universal_dirs(layout) == ["global_step3_universal"]


def test_delete_all_removes_every_copy_and_the_marker(tmp_path):
    layout = publish_three(tmp_path)
    result = prune(PruneRule(stage=1, ckpt_dir=LAYOUT, mode="delete-all"), layout)
    assert len(result.removed) == 3 and universal_dirs(layout) == []
    assert not (layout / LATEST_UNIVERSAL).exists()
    assert (layout / "global_step3" / ".metadata").is_file()
    assert prune(PruneRule(stage=1, ckpt_dir=LAYOUT, mode="delete-all"), layout).removed == ()


def test_prune_clears_what_a_killed_prune_left(tmp_path):
    layout = publish_three(tmp_path)
    os.replace(layout / "global_step1_universal", layout / "global_step1_universal.deleting")
    (layout / "global_step2_universal.deleting").mkdir()  # same name as a live one: removed first
    result = prune(PruneRule(stage=1, ckpt_dir=LAYOUT, mode="keep-latest"), layout)
    assert set(result.removed) == {"global_step1_universal", "global_step2_universal"}
    assert sorted(path.name for path in layout.iterdir() if path.is_dir()) == [
        "global_step1",
        "global_step2",
        "global_step3",
        "global_step3_universal",
    ]


def test_keep_latest_without_a_marker_removes_nothing(tmp_path, caplog):
    layout = publish_three(tmp_path)
    (layout / LATEST_UNIVERSAL).unlink()
    with caplog.at_level(logging.WARNING, logger="cona.runner.publish"):
        assert prune(PruneRule(stage=1, ckpt_dir=LAYOUT, mode="keep-latest"), layout).removed == ()
    assert "removes nothing" in caplog.text and len(universal_dirs(layout)) == 3
    assert (
        prune(PruneRule(stage=1, ckpt_dir="checkpoints/none", mode="delete-all"), tmp_path / "none").removed
        == ()
    )


def test_the_checkpoint_reader_is_imported_in_a_thread_of_its_own():
    """The runner starts without torch; the thread brings in what the first publish verifies with."""
    script = (
        "import sys\n"
        "from cona.runner.publish import import_checkpoint_reader_in_background\n"
        "assert 'torch' not in sys.modules\n"
        "thread = import_checkpoint_reader_in_background()\n"
        "thread.join(timeout=120)\n"
        "assert 'torch.distributed.checkpoint' in sys.modules and not thread.daemon\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("convert", [True, False])
def test_a_run_prepares_its_publisher_only_where_a_stage_may_publish(tmp_path, convert):
    chain = seed_shaped_chain(1)
    for step in chain["steps"]:
        step["convert"] = convert and step["step_num"] < len(chain["steps"])
    write_fake_chain_config(tmp_path)
    (tmp_path / "chain.json").write_text(json.dumps(chain))
    prepared: list[bool] = []
    run_chain(
        chain_run(tmp_path, tmp_path / "chain.json"),
        launcher=FakeEngine(),
        out=lambda line: None,
        prepare_publisher=lambda: prepared.append(True),
    )
    assert prepared == ([True] if convert else [])
