"""Checkpoints that cannot be trusted are refused: crafted pickles run nothing, corruption is caught by the
checksum manifest, and a failed save says why in one line. Each refusal names the file."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import pickle
import re
import shutil
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from tests.helpers.ckpt_tamper import Payload, crafted_metadata, flip_bytes, rewrite_manifest
from tests.helpers.small_checkpoint import ONE, save, small_config, trained
from tests.helpers.workers import ckpt_worker
from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

from cona.cli import main
from cona.engine.checkpoint import load as checkpoint_load
from cona.engine.checkpoint import save as ckpt
from cona.engine.checkpoint.dcp import failure_line
from cona.engine.checkpoint.info import resolve_checkpoint
from cona.engine.checkpoint.load import load_checkpoint, verify_checkpoint
from cona.engine.checkpoint.manifest import read_manifest, shares
from cona.errors import CheckpointError

BYTES_ENTRY = "param_groups.layers.0.w1.weight.lr"


@pytest.fixture
def saved(tmp_path: Path):
    config = small_config()
    model, optimizer = trained(config)
    return config, save(tmp_path / "work", config, model, optimizer, 2)


def fresh(config):
    return trained(config, steps=0, offset=0.5)


def refused_on_load(config, path: Path, match: str) -> str:
    model, optimizer = fresh(config)
    with pytest.raises(CheckpointError, match=match) as refused:
        load_checkpoint(path, model_parts=[model], optimizer=optimizer, config=config)
    assert "\n" not in str(refused.value)
    return str(refused.value)


# ------------------------------------------------------------------------------- crafted pickles


def test_the_payload_runs_code_when_unpickled_without_restriction(tmp_path: Path) -> None:
    """The proof the tests below rely on: plain unpickling of a Payload creates its marker."""
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(Payload(marker)))
    assert marker.exists()


def test_crafted_metadata_runs_nothing_on_inspect_or_load(saved, tmp_path: Path, capsys) -> None:
    config, path = saved
    marker = tmp_path / "ran"
    crafted_metadata(path, marker)
    rewrite_manifest(path)  # a crafted checkpoint comes with a manifest that matches it
    assert main(["ckpt", "inspect", str(path), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["problem"].startswith(f"{path}/.metadata: refused, it names pathlib")
    assert "nothing in it was run" in report["problem"]
    refused_on_load(
        config, path, rf"^{path}/.metadata: refused, it names pathlib\S*Path.touch, which is not DCP metadata"
    )
    assert main(["ckpt", "export", str(path), str(tmp_path / "out.safetensors")]) == 1
    assert ".metadata: refused" in capsys.readouterr().err
    assert not marker.exists()


def test_crafted_bytes_entry_runs_nothing_on_resume(tmp_path: Path, monkeypatch) -> None:
    """A checkpoint whose optimizer param_groups entry is a pickle that would run code (and whose manifest
    and DCP metadata are consistent with it) is refused on load, naming the shard file and the entry."""
    config = small_config()
    model, optimizer = trained(config)
    marker = tmp_path / "ran"
    state_of = ckpt.model_and_optimizer_state

    def planted(parts, opt):
        model_state, optim_state = state_of(parts, opt)
        return model_state, {**optim_state, BYTES_ENTRY: Payload(marker)}

    monkeypatch.setattr(ckpt, "model_and_optimizer_state", planted)
    path = save(tmp_path / "work", config, model, optimizer, 2)
    monkeypatch.undo()
    assert not marker.exists()
    message = refused_on_load(config, path, rf"^{path}/__0_0.distcp: entry optim.{BYTES_ENTRY} is not plain")
    assert "nothing in it was run" in message
    assert not marker.exists()
    # DCP's own reader would have run it: the refusal is what kept the marker away.
    model, optimizer = fresh(config)
    state = {"optim": dict(ckpt.model_and_optimizer_state([model], optimizer)[1])}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    assert marker.exists()


# ------------------------------------------------------------------------------- corruption


def test_flipped_bytes_in_a_weight_are_refused_naming_the_file(saved, tmp_path: Path, capsys) -> None:
    config, path = saved
    shard = flip_bytes(path, "model.layers.0.w1.weight")
    expected = rf"^{shard}: corrupt: its SHA-256 is not the one in manifest.json"
    refused_on_load(config, path, expected)
    assert main(["ckpt", "inspect", str(path), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["problem"].startswith(f"{shard}: corrupt")
    out = tmp_path / "out.safetensors"
    assert main(["ckpt", "export", str(path), str(out)]) == 1
    assert f"{shard}: corrupt" in capsys.readouterr().err and not out.exists()


def test_flipped_bytes_in_optimizer_state_are_refused_naming_the_file(saved) -> None:
    config, path = saved
    shard = flip_bytes(path, "optim.state.layers.0.w1.weight.exp_avg_sq")
    refused_on_load(config, path, rf"^{shard}: corrupt: its SHA-256 is not the one in manifest.json")


@pytest.mark.parametrize("ranks", [2, 3])
def test_each_rank_hashes_its_own_share_of_the_files(saved, tmp_path: Path, monkeypatch, ranks) -> None:
    """A load across ``ranks`` ranks splits the hashing: a damaged file of every share in turn is refused
    by the rank that holds it (each rank hashing share 0 would find none of the others' damage)."""
    _, path = saved
    sizes = {name: entry["size"] for name, entry in read_manifest(path)["files"].items()}
    parts = shares(sizes, ranks)
    assert all(parts), parts
    monkeypatch.setattr(checkpoint_load, "world_size", lambda: ranks)
    monkeypatch.setattr(checkpoint_load, "gather", lambda found: [found])  # each rank's own finding
    monkeypatch.setattr(checkpoint_load, "verify_complete", lambda path: None)  # reads what the hash refuses
    for share, names in enumerate(parts):
        damaged = Path(shutil.copytree(path, tmp_path / f"share{share}"))
        with open(damaged / names[0], "r+b") as handle:
            first = handle.read(1)
            handle.seek(0)
            handle.write(bytes([first[0] ^ 0xFF]))
        refusing = []
        for rank in range(ranks):
            monkeypatch.setattr(checkpoint_load, "rank", lambda rank=rank: rank)
            try:
                verify_checkpoint(damaged, collective=True)
            except CheckpointError as refusal:
                assert str(refusal).startswith(f"{damaged / names[0]}: corrupt"), str(refusal)
                refusing.append(rank)
        assert refusing == [share]


def test_an_edited_trainer_state_is_refused_naming_the_file(saved) -> None:
    config, path = saved
    state = json.loads((path / "trainer_state.json").read_text())
    (path / "trainer_state.json").write_text(json.dumps({**state, "consumed_tokens": 0}))
    refused_on_load(config, path, rf"^{path}/trainer_state.json: corrupt: ")


def test_an_edited_manifest_and_an_extra_file_are_refused(saved) -> None:
    config, path = saved
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["tied_parameters"] = [["tok_embeddings.weight", "output.weight"]]
    (path / "manifest.json").write_text(json.dumps(manifest))
    refused_on_load(config, path, rf"^{path}/manifest.json: altered or corrupt")
    rewrite_manifest(path)
    (path / "__9_0.distcp").write_bytes(b"planted")
    refused_on_load(config, path, rf"^{path}/__9_0.distcp: not in the checkpoint's manifest.json")


@pytest.mark.parametrize("where", ["absolute", "parent", "unlisted"])
def test_metadata_pointing_outside_the_checkpoint_is_refused_on_load_and_export(
    saved, tmp_path: Path, capsys, where: str
) -> None:
    """With ``.metadata`` and the manifest rewritten, a tensor record naming another checkpoint's shard
    (an absolute path or ``..``) or a file the manifest does not list is refused; nothing is read from it."""
    config, path = saved
    model, optimizer = trained(config, steps=3)
    other = save(tmp_path / "other", config, model, optimizer, 3)
    target = {
        "absolute": str(other / "__0_0.distcp"),
        "parent": os.path.relpath(other / "__0_0.distcp", path),
        "unlisted": "__7_0.distcp",
    }[where]
    metadata = dcp.FileSystemReader(path).read_metadata()
    metadata.storage_data = {
        index: dataclasses.replace(info, relative_path=target)
        for index, info in metadata.storage_data.items()
    }
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    rewrite_manifest(path)
    refusal = rf"^{path}/.metadata: tensor \S+ is stored at '{re.escape(target)}', "
    refused_on_load(config, path, refusal)
    out = tmp_path / "out.safetensors"
    assert main(["ckpt", "export", str(path), str(out)]) == 1
    assert f"{path}/.metadata: tensor " in capsys.readouterr().err and not out.exists()


def test_a_checkpoint_without_a_manifest_is_refused(saved) -> None:
    config, path = saved
    (path / "manifest.json").unlink()
    refused_on_load(config, path, rf"^{path}/manifest.json is missing: the checkpoint cannot be verified")


def test_a_differing_tied_copy_is_not_exported_as_an_untied_weight(tmp_path: Path, capsys) -> None:
    """A checkpoint whose two stored copies of a tied weight differ (checksums consistent: the damage was
    there when it was saved) is refused by export, which writes nothing."""
    config = small_config()
    model = ckpt_worker.build_model(config, ONE, None, 0.0)
    model.output.weight = model.tok_embeddings.weight
    optimizer = torch.optim.AdamW(model.parameters())
    path = save(tmp_path / "work", config, model, optimizer, 1)
    flip_bytes(path, "model.output.weight")
    rewrite_manifest(path)
    verify_checkpoint(path)
    out = tmp_path / "out.safetensors"
    assert main(["ckpt", "export", str(path), str(out)]) == 1
    err = capsys.readouterr().err
    assert f"{path}: tied weights tok_embeddings.weight and output.weight differ" in err
    assert err.count("\n") == 1 and not out.exists()


def test_verification_cost_on_a_small_checkpoint(saved) -> None:
    """Verifying the checksums is a small part of a load (printed; run with -s to see it)."""
    config, path = saved
    began = time.perf_counter()
    for _ in range(20):
        verify_checkpoint(path)
    verify_s = (time.perf_counter() - began) / 20
    model, optimizer = fresh(config)
    began = time.perf_counter()
    load_checkpoint(path, model_parts=[model], optimizer=optimizer, config=config)
    load_s = time.perf_counter() - began
    size = sum(f.stat().st_size for f in path.iterdir())
    print(f"\nverify {verify_s * 1e3:.2f} ms, whole load {load_s * 1e3:.1f} ms, {size} bytes")
    assert verify_s < load_s


# ------------------------------------------------------------------------------- failed saves


def test_a_full_disk_during_the_save_is_one_line_with_cause_and_path(saved, monkeypatch) -> None:
    config, path = saved
    model, optimizer = trained(config, steps=3)
    real_create_stream = dcp.filesystem.FileSystem.create_stream

    def full_disk(self, target, mode):
        if "w" in mode and str(target).endswith(".distcp"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(target))
        return real_create_stream(self, target, mode)

    monkeypatch.setattr(dcp.filesystem.FileSystem, "create_stream", full_disk)
    with pytest.raises(CheckpointError) as failed:
        save(path.parents[6], config, model, optimizer, 3)
    message = str(failed.value)
    assert "\n" not in message and "CheckpointException" not in message
    assert message.startswith(
        f"saving checkpoint {path.parent}/global_step3 failed: no space left on {path.parent} ("
    )
    assert "bytes free); on rank 0: OSError: [Errno 28] No space left on device" in message
    assert ".tmp-global_step3-" in message
    assert resolve_checkpoint(path.parent) == path  # the previous checkpoint stays latest
    assert not list(path.parent.glob(".tmp-*"))  # the failed temporary holds no space


def test_a_short_write_on_a_full_disk_says_no_space_left_and_removes_the_temporary(
    saved, monkeypatch
) -> None:
    """torch's zip writer reports a short write on a full disk as ``unexpected pos``, naming no space: the
    save says the disk is full, with the bytes free, and removes its temporary."""
    config, path = saved
    model, optimizer = trained(config, steps=3)
    real_create_stream = dcp.filesystem.FileSystem.create_stream

    def short_write(self, target, mode):
        if "w" in mode and str(target).endswith(".distcp"):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 320 vs 256")
        return real_create_stream(self, target, mode)

    monkeypatch.setattr(dcp.filesystem.FileSystem, "create_stream", short_write)
    usage = shutil.disk_usage(path.parent)
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda where: usage._replace(free=4096))
    with pytest.raises(CheckpointError) as failed:
        save(path.parents[6], config, model, optimizer, 3)
    message = str(failed.value)
    assert message.startswith(
        f"saving checkpoint {path.parent}/global_step3 failed: no space left on {path.parent} "
        "(4096 bytes free); on rank 0: RuntimeError: [enforce fail at inline_container.cc:672] . "
        "unexpected pos"
    )
    assert "\n" not in message
    assert not list(path.parent.glob(".tmp-*"))
    assert resolve_checkpoint(path.parent) == path


def test_an_unwritable_layout_directory_is_one_line(saved, monkeypatch) -> None:
    config, path = saved
    model, optimizer = trained(config, steps=3)
    layout = path.parent

    def no_permission(self, *args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))

    shutil.rmtree(layout)
    monkeypatch.setattr(Path, "mkdir", no_permission)
    with pytest.raises(CheckpointError) as failed:
        save(path.parents[6], config, model, optimizer, 3)
    assert str(failed.value) == (
        f"saving a checkpoint into {layout} failed on rank 0: [Errno 13] Permission denied: '{layout}'"
    )


def test_failures_on_several_ranks_are_one_line_with_the_first_cause() -> None:
    """What DCP raises when both ranks of a save hit a full disk (its str starts 'CheckpointException
    ranks:dict_keys([0, 1])', the causes only in per-rank tracebacks)."""
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/w/.tmp-global_step3-ab/__1_0.distcp")
    raised = CheckpointException("write_data", {1: _wrap_exception(full), 0: _wrap_exception(full)})
    assert str(raised).startswith("CheckpointException ranks:dict_keys([1, 0])")
    line = str(failure_line(raised, "saving checkpoint /w/global_step3 failed"))
    assert line == (
        "saving checkpoint /w/global_step3 failed on rank 0: OSError: [Errno 28] No space left on device: "
        "'/w/.tmp-global_step3-ab/__1_0.distcp' (also on rank 1)"
    )
