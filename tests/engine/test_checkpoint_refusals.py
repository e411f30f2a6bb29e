"""Checkpoints that are refused on load: missing or broken files, another model shape or format version, a
missing tensor. Each refusal names the path and what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.helpers.ckpt_tamper import rewrite_manifest
from tests.helpers.small_checkpoint import assert_same_state, save, small_config, trained
from torch import nn

from cona.engine.checkpoint.files import verify_complete
from cona.engine.checkpoint.info import resolve_checkpoint
from cona.engine.checkpoint.load import load_checkpoint
from cona.engine.checkpoint.manifest import FORMAT_VERSION
from cona.engine.optim import build_optimizer
from cona.errors import CheckpointError


@pytest.fixture
def saved(tmp_path: Path):
    config = small_config()
    model, optimizer = trained(config)
    return config, save(tmp_path, config, model, optimizer, 2), (model, optimizer)


def test_missing_path_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"checkpoint .*nowhere does not exist"):
        resolve_checkpoint(tmp_path / "nowhere")


def test_directory_without_marker_is_refused(tmp_path: Path) -> None:
    with pytest.raises(
        CheckpointError, match=r"no checkpoint here: no 'latest' or 'latest_universal' marker"
    ):
        resolve_checkpoint(tmp_path)


def test_marker_naming_a_missing_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "latest").write_text("global_step7\n")
    with pytest.raises(CheckpointError, match=r"latest names global_step7, which does not exist"):
        resolve_checkpoint(tmp_path)


def test_missing_metadata_is_refused(saved) -> None:
    config, path, (model, optimizer) = saved
    (path / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"global_step2/.metadata: missing \(the checkpoint's manifest"):
        load_checkpoint(path.parent, model_parts=[model], optimizer=optimizer, config=config)
    with pytest.raises(CheckpointError, match=r"global_step2: incomplete checkpoint: no DCP .metadata file"):
        verify_complete(path)


def test_unreadable_metadata_is_refused(saved) -> None:
    _, path, _ = saved
    (path / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(CheckpointError, match=r"global_step2/.metadata: unreadable \(UnpicklingError\)"):
        verify_complete(path)


def test_truncated_shard_is_refused(saved) -> None:
    config, path, (model, optimizer) = saved
    (shard,) = path.glob("*.distcp")
    size = shard.stat().st_size
    with shard.open("r+b") as handle:
        handle.truncate(size - 100)
    message = rf"global_step2/{shard.name}: corrupt: {size - 100} bytes, manifest.json says {size}"
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(path, model_parts=[model], optimizer=optimizer, config=config)
    message = rf"global_step2: shard file {shard.name} is truncated \({size - 100} of {size} bytes\)"
    with pytest.raises(CheckpointError, match=message):
        verify_complete(path)


def test_missing_shard_is_refused(saved) -> None:
    _, path, _ = saved
    (shard,) = path.glob("*.distcp")
    shard.unlink()
    with pytest.raises(
        CheckpointError,
        match=rf"global_step2: incomplete checkpoint: shard file {shard.name} is "
        r"missing",
    ):
        verify_complete(path)


def test_missing_trainer_state_is_refused(saved) -> None:
    _, path, _ = saved
    (path / "trainer_state.json").unlink()
    with pytest.raises(CheckpointError, match=r"incomplete checkpoint: trainer_state.json is missing"):
        verify_complete(path)


def test_other_model_shape_is_refused_naming_the_key(saved) -> None:
    _, path, _ = saved
    other = small_config(hidden=32)
    model, optimizer = trained(other, steps=0)
    with pytest.raises(
        CheckpointError, match=r"another model shape: model.hidden is 16 there and 32 in the current"
    ):
        load_checkpoint(path, model_parts=[model], optimizer=optimizer, config=other)


def test_checkpoint_from_before_the_family_keys_loads(saved) -> None:
    """A config.json written before model.family and its keys existed means a GPT: it still loads."""
    config, path, trained_pair = saved
    written = json.loads((path / "config.json").read_text())
    family_keys = (
        "family",
        "activation",
        "position_embedding",
        "rope_theta",
        "kv_heads",
        "tie_embeddings",
        "bias",
    )
    written["model"] = {k: v for k, v in written["model"].items() if k not in family_keys}
    (path / "config.json").write_text(json.dumps(written))
    rewrite_manifest(path)
    model, optimizer = trained(config, steps=0, offset=1.0)
    load_checkpoint(path, model_parts=[model], optimizer=optimizer, config=config)
    assert_same_state(trained_pair, (model, optimizer))


def test_other_family_is_refused_naming_the_key(saved) -> None:
    _, path, _ = saved
    other = small_config(kv_heads=1)
    model, optimizer = trained(other, steps=0)
    with pytest.raises(CheckpointError, match=r"another model shape: model.kv_heads is 2 there and 1 in the"):
        load_checkpoint(path, model_parts=[model], optimizer=optimizer, config=other)


def test_other_format_version_is_refused(saved) -> None:
    config, path, (model, optimizer) = saved
    manifest = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps({**manifest, "format_version": 99}))
    with pytest.raises(
        CheckpointError,
        match=rf"global_step2: checkpoint format version 99; this CONA reads {FORMAT_VERSION}",
    ):
        load_checkpoint(path, model_parts=[model], optimizer=optimizer, config=config)


def test_missing_tensor_is_refused_by_name(saved) -> None:
    config, path, _ = saved
    model, optimizer = trained(config, steps=0)
    model.extra = nn.Linear(2, 2)  # a parameter the checkpoint never had
    optimizer = build_optimizer([model], config.training)
    with pytest.raises(CheckpointError, match=r"the checkpoint has no model tensor extra.weight"):
        load_checkpoint(path, model_parts=[model], optimizer=optimizer, config=config)
