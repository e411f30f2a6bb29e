"""The one reader of CONA's JSON-lines files (``metrics.jsonl``, ``decisions.jsonl``, the step traces).

Two ways to read: :func:`read_lines` reads a whole file once (``cona report``, ``cona plan --trace``, a
resumed run's noise scale), :class:`JsonlTail` reads what another process appended since the last call (the
online search, the console). Both decode bytes leniently (a torn multi-byte character reads as U+FFFD, never
as an exception) and skip blank lines; what a caller does with a line that is not valid JSON (skip it, warn,
refuse the file) is its own choice, so each line comes with its number and its error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class JsonlLine:
    """One non-blank line of a JSON-lines file."""

    number: int
    """1 for the first line of the file."""
    value: Any
    """The decoded JSON value (None where ``error`` is set)."""
    error: json.JSONDecodeError | None
    unterminated: bool
    """The file's last line, without its newline: one a writer may still be writing (or was killed in)."""


def read_lines(path: Path) -> list[JsonlLine]:
    """Every non-blank line of ``path``, decoded or with its error; a missing file reads as empty."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return []
    raw_lines = data.split(b"\n")
    lines = (_decode(raw, number, number == len(raw_lines)) for number, raw in enumerate(raw_lines, start=1))
    return [line for line in lines if line is not None]


def _decode(raw: bytes, number: int, unterminated: bool) -> JsonlLine | None:
    """The line, or None for a blank one."""
    text = raw.decode("utf-8", errors="replace")
    if not text.strip():
        return None
    try:
        return JsonlLine(number=number, value=json.loads(text), error=None, unterminated=unterminated)
    except json.JSONDecodeError as err:
        return JsonlLine(number=number, value=None, error=err, unterminated=unterminated)


def read_records(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of ``path``, in file order; every other line (torn, not an object) is skipped."""
    return [line.value for line in read_lines(path) if isinstance(line.value, dict)]


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
        lines = (_decode(raw, 0, False) for raw in complete.split(b"\n"))
        return [line.value for line in lines if line is not None and isinstance(line.value, dict)]
