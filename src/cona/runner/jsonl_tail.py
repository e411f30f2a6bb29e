"""Incremental reads of a JSON-lines file that another process appends to (``metrics.jsonl``,
``decisions.jsonl``): each call returns the objects of the lines completed since the previous one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class JsonlTail:
    """Reads the complete lines appended to ``path`` since the last call, from byte ``offset`` on.

    A half-written last line (no newline yet) is left for a later call, so a record is never read torn; a
    complete line that is not a JSON object (the tail of a line a killed writer left) is skipped. A file
    that does not exist yet reads as empty."""

    def __init__(self, path: Path, offset: int = 0) -> None:
        self.path = Path(path)
        self.offset = offset

    @classmethod
    def at_end(cls, path: Path) -> JsonlTail:
        """A tail that returns only what is appended from now on (up to the last complete line)."""
        tail = cls(path)
        tail.new_records()
        return tail

    def new_records(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self.offset)
                chunk = handle.read()
        except FileNotFoundError:
            return []
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self.offset += len(complete)
        records = []
        for line in complete.splitlines():
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            if isinstance(record, dict):
                records.append(record)
        return records
