"""Subcommands of ``cona``: each module has ``register(subparsers)`` and keeps its logic elsewhere."""

from __future__ import annotations

import argparse

from cona.errors import ConaError


def not_yet(subparsers, name: str, help_text: str, issue: int) -> argparse.ArgumentParser:
    """A subcommand that a later issue fills in: it exists in ``--help`` and says so, and does nothing."""
    parser = subparsers.add_parser(
        name,
        help=f"{help_text} (not available yet: issue {issue})",
        description=f"{help_text}. Not available yet: added by issue {issue}.",
    )
    parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)

    def refuse(args: argparse.Namespace) -> int:
        raise ConaError(f"'cona {name}' is not available yet (issue {issue} adds it)")

    parser.set_defaults(func=refuse)
    return parser
