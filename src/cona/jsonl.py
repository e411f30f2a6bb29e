"""The one reader of CONA's JSON-lines files (``metrics.jsonl``, ``decisions.jsonl``, the step traces).

Two ways to read: :func:`read_lines` reads a whole file once (``cona plan --trace``, a resumed run's noise
scale; :func:`read_json_lines` for ``cona report``, which turns each bad line into a warning);
:class:`JsonlTail` reads what another process appended since the last call (the online search, the
console). Both decode bytes leniently (a torn multi-byte character reads as U+FFFD, never as an exception)
and skip blank lines; what a caller does with a line that is not valid JSON (skip it, warn, refuse the file)
is its own choice, so each line comes with its number and its error.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
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


def read_json(path: Path) -> Any:
    """A whole JSON file (a run's state, a stage's records), its bytes decoded leniently as :func:`read_lines`
    does: a damaged file then fails as JSON that does not parse (``json.JSONDecodeError``), which the caller
    words for its file, never as a ``UnicodeDecodeError``. A missing file raises ``FileNotFoundError``."""
    return json.loads(Path(path).read_bytes().decode("utf-8", errors="replace"))


def read_records(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of ``path``, in file order; every other line (torn, not an object) is skipped."""
    return [line.value for line in read_lines(path) if isinstance(line.value, dict)]


@dataclass(frozen=True, kw_only=True)
class JsonLines:
    records: tuple[dict[str, Any], ...]
    warnings: tuple[str, ...]


def read_json_lines(
    path: Path, *, required: Sequence[str] = (), check: Callable[[dict[str, Any]], object] | None = None
) -> JsonLines:
    """The JSON objects of a JSON-lines file; each line that is not one (or lacks ``required`` keys, or
    ``check`` raises ValueError for) is skipped with a warning naming the file and line. A missing file
    reads as empty."""
    records, warnings = [], []
    for line in read_lines(path):
        record, problem, err = line.value, None, line.error
        if err is not None:
            problem = f"not valid JSON ({err.msg}, column {err.colno})"
            if line.unterminated:  # the line a writer has not finished
                problem = "truncated last line (being written, or its writer was killed)"
        if record is not None and not isinstance(record, dict):
            problem = f"a JSON {type(record).__name__}, not an object"
        elif record is not None:
            missing = [key for key in required if not is_number(record.get(key))]
            problem = f"no number for {', '.join(missing)}" if missing else _check(check, record)
        if problem is None:
            records.append(record)
        else:
            warnings.append(f"{path}: line {line.number}: {problem}; skipped")
    return JsonLines(records=tuple(records), warnings=tuple(warnings))


def _check(check: Callable[[dict[str, Any]], object] | None, record: dict[str, Any]) -> str | None:
    try:
        if check is not None:
            check(record)
    except ValueError as err:
        return str(err)
    return None


def is_number(value: Any) -> bool:
    """A JSON number (not a bool, which Python counts as an int)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


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
