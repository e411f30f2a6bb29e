"""``--set SECTION.KEY=VALUE``: config keys given on the command line, over the ``.conaconfig``'s.

One place for every command that loads a config (:func:`cona.config.file.load_config` applies them): the
value is read as JSON when it parses as JSON (``3e-4``, ``true``, ``null``, ``[1, 2]``, ``"quoted"``), else
taken as the string it is (``bf16``, ``949,50,1``, ``data/x_text_document``). The override replaces the
key in the file's raw JSON before validation, so the config's own checks (types, ranges, choices) judge
it like a key of the file; an unknown section or key is refused here, naming it. A relative path given
this way is relative to the current directory (where the command line was typed), not to the file.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from cona.config.fields import reject_unknown
from cona.errors import UsageError

FLAG = "--set"
SECTIONS = ("model", "training")


def parse_override(text: str) -> tuple[str, str, Any]:
    """``"training.base_lr=3e-4"`` -> ``("training", "base_lr", 0.0003)``; a malformed one is refused."""
    dotted, equals, value_text = text.partition("=")
    section, dot, key = dotted.strip().partition(".")
    if not equals or not dot or not key or "." in key:
        raise UsageError(f"{FLAG} {text!r}: expected SECTION.KEY=VALUE, e.g. training.base_lr=3e-4")
    if section not in SECTIONS:
        raise UsageError(f"{FLAG} {text!r}: unknown section {section!r}; the sections are model and training")
    return section, key, _value(value_text)


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text  # a bare word or path: the string itself


def apply_overrides(
    raw: Any,
    overrides: Sequence[str],
    *,
    known_keys: dict[str, Iterable[str]],
    path_keys: Iterable[str],
    cwd: Path | None = None,
) -> Any:
    """A copy of the decoded config ``raw`` with ``overrides`` applied in order (the last of a key wins).

    ``known_keys`` maps each section to its keys (an unknown one is refused naming it); string values of
    ``path_keys`` are made absolute against ``cwd`` (default: the current directory)."""
    if not overrides:
        return raw
    if not isinstance(raw, dict):
        return raw  # parse_config names what is wrong with the file itself
    updated = copy.deepcopy(raw)
    base = cwd or Path.cwd()
    for text in overrides:
        section, key, value = parse_override(text)
        reject_unknown(
            {key: value}, known_keys[section], f"{FLAG} {text}", prefix=f"{section}.", error=UsageError
        )
        if section == "training" and key in path_keys and isinstance(value, str):
            value = str((base / Path(value).expanduser()).resolve())
        target = updated.setdefault(section, {})
        if not isinstance(target, dict):
            return updated  # the file's section is not an object: parse_config says so
        target[key] = value
    return updated
