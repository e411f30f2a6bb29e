"""Typed reading of a JSON config section into a dataclass's fields, with one-line errors naming the key.

Generic (no knowledge of CONA's keys): unknown keys get a "did you mean", placeholders copied from an example
(``"<num_layers>"``) and numbers written as strings are named as such, ints widen to floats, and ``Literal``
fields list their choices. :mod:`cona.config.conaconfig` applies it to the ``model`` section and to each part
of the ``training`` section.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

from cona.errors import ConaError, ConfigError


def read_json_file(path: Path) -> Any:
    """The JSON document of ``path``; invalid JSON, a key twice in one object (json.loads would keep the
    last silently) and non-UTF-8 bytes are refused naming the file."""
    try:
        return json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=_refuse_duplicate_keys)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: not valid JSON: {err.msg} at line {err.lineno}") from None
    except _DuplicateKey as err:
        raise ConfigError(f"{path}: key {err.args[0]!r} appears twice; keep one") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a UTF-8 text file") from None


class _DuplicateKey(Exception):
    pass


def _refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    document: dict[str, Any] = {}
    for key, value in pairs:
        if key in document:
            raise _DuplicateKey(key)
        document[key] = value
    return document


def expect_section(raw: dict, name: str, where: str) -> dict:
    section = raw[name]
    if not isinstance(section, dict):
        raise ConfigError(f"{where}: '{name}' must be an object, got {type(section).__name__}")
    return section


def reject_unknown(
    raw: dict, known: typing.Iterable[str], where: str, prefix: str = "", error: type[ConaError] = ConfigError
) -> None:
    """Refuse the first key of ``raw`` not in ``known`` with ``error``, naming the closest known key."""
    known = list(known)
    for key in raw:
        if key in known:
            continue
        hint = difflib.get_close_matches(key, known, n=1)
        suggestion = f"; did you mean '{prefix}{hint[0]}'?" if hint else ""
        raise error(f"{where}: unknown key '{prefix}{key}'{suggestion}")


def typed_values(cls: type, raw: dict, where: str, section: str) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    reject_unknown(raw, fields, where, prefix=f"{section}.")
    values: dict[str, Any] = {}
    for name, f in fields.items():
        key = f"{section}.{name}"
        if name not in raw:
            if f.default is dataclasses.MISSING:
                raise ConfigError(f"{where}: missing required key '{key}'")
            continue
        values[name] = _check_type(raw[name], hints[name], where, key)
    return values


def _check_type(value: Any, hint: Any, where: str, key: str) -> Any:
    """Return ``value`` if it fits ``hint`` (ints widen to float); raise a one-line error otherwise."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    optional = origin in (typing.Union, types.UnionType) and type(None) in args
    if optional:
        if value is None:
            return None
        hint = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(hint), typing.get_args(hint)
    if isinstance(value, str) and re.fullmatch(r"<[^<>]*>", value.strip()):
        raise ConfigError(f"{where}: {key}: {value!r} is a placeholder from the example; put a real value")
    if origin is Literal:
        if value not in args:
            choices = ", ".join(repr(a) for a in args)
            raise ConfigError(f"{where}: {key}: {value!r} is not one of {choices}")
        return value
    expected = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[hint]
    ok = (
        (hint is bool and isinstance(value, bool))
        or (hint is int and isinstance(value, int) and not isinstance(value, bool))
        or (hint is float and isinstance(value, int | float) and not isinstance(value, bool))
        or (hint is str and isinstance(value, str))
    )
    if not ok:
        if isinstance(value, str) and hint in (int, float) and _looks_numeric(value):
            raise ConfigError(
                f"{where}: {key}: expected {expected}, got the string {value!r}; drop the quotes"
            )
        raise ConfigError(f"{where}: {key}: expected {expected}, got {json.dumps(value)}")
    if hint is float:
        value = float(value)
        if not math.isfinite(value):
            raise ConfigError(f"{where}: {key}: must be finite")
    return value


def _looks_numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
