"""A checkpoint's ``manifest.json``: what it holds and the SHA-256 of every file it was saved with.

The manifest lists every file of the checkpoint directory (DCP shards and ``.metadata``, trainer state,
config, strategy, probe) with its size and SHA-256, and carries the SHA-256 of its own other fields
(``digest``), so a changed manifest is told from a changed file. The saver writes it into the temporary
directory before the rename that publishes the checkpoint: a published checkpoint always has one. It names
files relative to the checkpoint directory, so a hard-linked copy (``global_step<N>_universal``) has the same
manifest, and a load under another layout reads the same files. Hashing streams each file
(:func:`hashlib.file_digest`); the checks here are of one process, :mod:`cona.engine.checkpoint.load` spreads
them over the ranks.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from cona.atomic_files import write_json_atomic
from cona.errors import CheckpointError

MANIFEST_FILE = "manifest.json"
FORMAT_VERSION = 2
"""2: the manifest carries the files' checksums (version 1 had none)."""


def checksum(path: Path) -> dict[str, Any]:
    """``{"size": bytes, "sha256": hex}`` of one file, read in a streaming way."""
    with open(path, "rb") as handle:
        digest = hashlib.file_digest(handle, "sha256").hexdigest()
    return {"size": Path(path).stat().st_size, "sha256": digest}


def present_files(directory: Path) -> dict[str, int]:
    """Every file under ``directory`` but the manifest, by relative name, with its size."""
    directory = Path(directory)
    return {
        str(path.relative_to(directory)): path.stat().st_size
        for path in sorted(directory.rglob("*"))
        if path.is_file() and path.name != MANIFEST_FILE
    }


def write_manifest(directory: Path, fields: dict[str, Any], files: dict[str, dict[str, Any]]) -> None:
    """Write ``manifest.json``: ``fields`` (format version first), the files' checksums and the digest."""
    body = {"format_version": FORMAT_VERSION, **fields, "files": dict(sorted(files.items()))}
    document = {**body, "digest": _digest(body)}
    write_json_atomic(Path(directory) / MANIFEST_FILE, document, sort_keys=True)  # fsynced before the publish


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest of a checkpoint, refused (naming it) when missing, of another format or altered."""
    file = Path(directory) / MANIFEST_FILE
    if not file.is_file():
        raise CheckpointError(f"{file} is missing: the checkpoint cannot be verified; refusing it")
    try:
        document = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"{file}: not valid JSON; refusing the checkpoint") from None
    if not isinstance(document, dict):
        raise CheckpointError(f"{file}: expected a JSON object; refusing the checkpoint")
    version = document.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{Path(directory)}: checkpoint format version {version}; this CONA reads {FORMAT_VERSION}"
        )
    body = {key: value for key, value in document.items() if key != "digest"}
    if document.get("digest") != _digest(body) or not _well_formed(document.get("files")):
        raise CheckpointError(f"{file}: altered or corrupt (its digest does not match); refusing it")
    return document


def unlisted_or_missing(directory: Path, manifest: dict[str, Any]) -> str | None:
    """The first file present but not in the manifest, or listed but absent (a message), else None."""
    present, listed = present_files(directory), manifest["files"]
    for name in sorted(set(listed) - set(present)):
        return f"{Path(directory) / name}: missing (the checkpoint's {MANIFEST_FILE} lists it); refusing it"
    for name in sorted(set(present) - set(listed)):
        return f"{Path(directory) / name}: not in the checkpoint's {MANIFEST_FILE}; refusing the checkpoint"
    return None


def first_mismatch(directory: Path, manifest: dict[str, Any], names: Iterable[str]) -> str | None:
    """The first of ``names`` whose size or SHA-256 differs from the manifest's (a message), else None."""
    for name in names:
        file = Path(directory) / name
        expected = manifest["files"][name]
        try:
            size = file.stat().st_size
            actual = checksum(file) if size == expected["size"] else None
        except OSError as err:
            return f"{file}: unreadable ({err.strerror}); refusing the checkpoint"
        if size != expected["size"]:
            return f"{file}: corrupt: {size} bytes, {MANIFEST_FILE} says {expected['size']}; refusing it"
        if actual is not None and actual["sha256"] != expected["sha256"]:
            return f"{file}: corrupt: its SHA-256 is not the one in {MANIFEST_FILE}; refusing the checkpoint"
    return None


def shares(sizes: dict[str, int], parts: int) -> list[list[str]]:
    """``sizes``' names in ``parts`` lists of about equal bytes (largest first, each to the lightest list)."""
    lists: list[list[str]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        lightest = loads.index(min(loads))
        lists[lightest].append(name)
        loads[lightest] += sizes[name]
    return lists


def _digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _well_formed(files: Any) -> bool:
    return isinstance(files, dict) and all(
        isinstance(entry, dict)
        and isinstance(entry.get("size"), int)
        and isinstance(entry.get("sha256"), str)
        for entry in files.values()
    )
