"""What the checkpoint tests do to checkpoints: damage bytes of one entry, plant pickles that would run code
(``Payload``: unpickling it creates a file), and rewrite the manifest to match (as someone who crafts a
checkpoint can, so the tests reach the checks behind the checksums)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch.distributed.checkpoint as dcp

from cona.engine.checkpoint.manifest import MANIFEST_FILE, checksum, present_files, write_manifest


class Payload:
    """Unpickling this creates ``marker`` (through ``Path.touch``): the proof that a load ran code."""

    def __init__(self, marker: Path) -> None:
        self.marker = Path(marker)

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def rewrite_manifest(checkpoint: Path) -> None:
    """Recompute the manifest's checksums for the files as they are now (keeping its other fields)."""
    manifest = json.loads((checkpoint / MANIFEST_FILE).read_text())
    fields = {k: v for k, v in manifest.items() if k not in ("files", "digest", "format_version")}
    write_manifest(
        checkpoint, fields, {name: checksum(checkpoint / name) for name in present_files(checkpoint)}
    )


def entry_location(checkpoint: Path, fqn: str) -> tuple[Path, int, int]:
    """(shard file, offset, length) of the first stored chunk of DCP entry ``fqn``."""
    metadata = dcp.FileSystemReader(checkpoint).read_metadata()
    info = next(info for index, info in metadata.storage_data.items() if index.fqn == fqn)
    return checkpoint / info.relative_path, info.offset, info.length


def flip_bytes(checkpoint: Path, fqn: str, count: int = 64) -> Path:
    """Invert ``count`` bytes in the middle of entry ``fqn``'s stored data; returns the shard file."""
    file, offset, length = entry_location(checkpoint, fqn)
    start = offset + max(0, length // 2 - count // 2)
    with open(file, "r+b") as handle:
        handle.seek(start)
        data = handle.read(count)
        handle.seek(start)
        handle.write(bytes(b ^ 0xFF for b in data))
    return file


def crafted_metadata(checkpoint: Path, marker: Path) -> None:
    """Replace ``.metadata`` by a pickle whose unpickling would create ``marker``."""
    (checkpoint / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
