"""The one atomic writer: a reader sees the old file or the new one, and both the bytes and the rename are
fsynced before it returns."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import cona.atomic_files as atomic_files
from cona.atomic_files import atomic_open, private_tmp, write_atomic, write_json_atomic


def test_replaces_the_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_text("old\n")
    assert write_json_atomic(path, {"b": 1, "a": [2]}) == path
    assert path.read_text() == '{\n "b": 1,\n "a": [\n  2\n ]\n}\n'  # indent 1, key order kept
    write_json_atomic(path, {"b": 1, "a": 2}, indent=None, sort_keys=True)
    assert json.loads(path.read_text()) == {"a": 2, "b": 1} and path.read_text() == '{"a": 2, "b": 1}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_a_failed_write_keeps_the_old_file_and_removes_its_temporary(tmp_path: Path) -> None:
    path = tmp_path / "spec.json"
    path.write_text("old\n")
    with pytest.raises(RuntimeError), atomic_open(path) as handle:
        handle.write("half of the new")
        raise RuntimeError("killed while writing")
    assert path.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.json"]


def test_fsyncs_the_file_before_the_rename_and_the_directory_after(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "marker"
    synced: list[tuple[str, bool]] = []  # (what the descriptor is, whether the target had the new bytes)
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        kind = "dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "file"
        synced.append((kind, path.exists() and path.read_bytes() == b"new"))
        real_fsync(fd)

    monkeypatch.setattr(atomic_files.os, "fsync", recording_fsync)
    write_atomic(path, b"new")
    assert synced == [("file", False), ("dir", True)]


def test_every_writer_has_its_own_temporary(tmp_path: Path) -> None:
    path = tmp_path / "fixed_chain.json"
    first, second = private_tmp(path), private_tmp(path)
    assert first != second and first.parent == tmp_path
    assert first.name.startswith(".fixed_chain.json.") and first.name.endswith(".tmp")


def test_a_named_temporary_is_used_as_given(tmp_path: Path) -> None:
    path, tmp = tmp_path / "latest", tmp_path / ".tmp-latest-ab12"
    with atomic_open(path, tmp=tmp) as handle:
        handle.write("global_step4\n")
        assert tmp.is_file()
    assert path.read_text() == "global_step4\n" and not tmp.exists()
