"""The one entry point, ``cona``. It only parses and dispatches: each subcommand lives in
``cona.commands.<name>`` with ``register(subparsers)`` that adds its parser and sets ``func``."""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from typing import Any

from cona import __version__
from cona.errors import ConaError, UsageError

USAGE_EXIT = 2
"""A command line that does not go together: argparse's own status for a usage error."""
TRACEBACK_ENV = "CONA_TRACEBACK"
"""Set (to anything) to see a failed file operation's traceback, not only its one line."""
FAILURE_EXIT = 1
"""Anything else CONA refuses or that fails at run time: a bad config, data, checkpoint, a failed stage."""

# Order is the order `cona --help` lists them in.
COMMAND_MODULES = (
    "train",
    "demo",
    "preprocess",
    "data",
    "config",
    "strategies",
    "predict",
    "plan",
    "systems",
    "ckpt",
    "report",
    "status",
)


class WholeFlagParser(argparse.ArgumentParser):
    """A parser that takes flags only as written in full: ``--iter 2`` is refused, not read as ``--iters``
    (an abbreviation would silently change meaning once a second flag shares its prefix). Sub-commands
    are made of the parent's class, so every parser of ``cona`` is one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = WholeFlagParser(
        prog="cona",
        description="Train language models under a chain of parallel strategies (dp, tp, pp, mbs, gbs).",
    )
    parser.add_argument("--version", action="version", version=f"cona {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"cona.commands.{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return USAGE_EXIT
    try:
        return int(args.func(args) or 0)
    except ConaError as err:
        print(f"cona: error: {err}", file=sys.stderr)
        return USAGE_EXIT if isinstance(err, UsageError) else FAILURE_EXIT
    except OSError as err:
        if err.filename is None or os.environ.get(TRACEBACK_ENV):
            raise  # not about a path the user gave (a bug), or asked for: with its traceback
        print(f"cona: error: {os_error_text(err)}", file=sys.stderr)
        return FAILURE_EXIT
    except RuntimeError as err:
        loop = symlink_loop(err)
        if loop is None or os.environ.get(TRACEBACK_ENV):
            raise
        print(f"cona: error: {loop}: a symbolic link loop", file=sys.stderr)
        return FAILURE_EXIT
    except KeyboardInterrupt as err:
        print(f"cona: {err}" if str(err) else "cona: interrupted", file=sys.stderr)
        return int(getattr(err, "exit_code", 130))


SYMLINK_LOOP = re.compile(r"Symlink loop from '(?P<path>.*)'")
"""What ``Path.resolve`` raises (a RuntimeError) for a symbolic link loop before Python 3.13, which raises
an ``OSError`` (ELOOP) naming the path instead."""


def symlink_loop(err: RuntimeError) -> str | None:
    """The path of pathlib's symbolic-link-loop error (None: another RuntimeError, a bug)."""
    match = SYMLINK_LOOP.fullmatch(str(err))
    return match.group("path") if match else None


def os_error_text(err: OSError) -> str:
    """``path: reason`` of a failed file operation (both paths of a rename or link)."""
    where = str(err.filename) if err.filename2 is None else f"{err.filename} -> {err.filename2}"
    return f"{where}: {err.strerror or type(err).__name__}"


if __name__ == "__main__":
    raise SystemExit(main())
