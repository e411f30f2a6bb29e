"""What an offline W&B run folder holds, read back from its transaction log (``run-<id>.wandb``): the run's
id and the rows it logged. The log is LevelDB's log format (32 KiB blocks of records, each with a 7-byte
header: checksum, length, type) after W&B's own 7-byte file header, each record a ``Record`` protobuf."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _chunks(data: bytes):
    position, pending = HEADER, b""
    while position + HEADER <= len(data):
        left = BLOCK - position % BLOCK
        if left < HEADER:  # a block's tail too short for a header is padding
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + HEADER])
        if kind == 0 and length == 0:
            position += left
            continue
        chunk = data[position + HEADER : position + HEADER + length]
        position += HEADER + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            yield pending + chunk


def _settled_bytes(log: Path, timeout_s: float = 30.0) -> bytes:
    """The log's bytes once W&B's service process has written it out: ``wandb.finish`` returns before that
    process flushes an offline run, so the file is read when its size has held still for half a second."""
    deadline, data = time.monotonic() + timeout_s, log.read_bytes()
    while time.monotonic() < deadline:
        time.sleep(0.5)
        again = log.read_bytes()
        if len(again) == len(data) and len(data) > HEADER:
            return data
        data = again
    return data


def read_offline_run(folder: Path) -> tuple[str, list[dict[str, Any]]]:
    """The run id and the logged rows (user keys only) of one ``offline-run-*`` folder."""
    from wandb.proto import wandb_internal_pb2

    (log,) = Path(folder).glob("run-*.wandb")
    data = _settled_bytes(log)
    assert data[:4] == b":W&B", f"{log}: not a W&B transaction log"
    run_id, rows = "", []
    for raw in _chunks(data):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = run_id or record.run.run_id  # a later run record (an update) may leave it empty
        elif kind == "history":
            row = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            rows.append({key: value for key, value in row.items() if not key.startswith("_")})
    return run_id, rows
