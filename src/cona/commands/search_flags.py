"""``--botorch`` / ``--exhaustive`` (``--no-botorch``): which search finds a gbs's best strategy, the same
on cona train (online mode), strategies and plan. Neither: chosen by the size of the space
(:mod:`cona.planner.search_choice`)."""

from __future__ import annotations

import argparse
from typing import Any

from cona.errors import UsageError


def add_search_flags(parser: Any) -> None:
    """The two flags on ``parser`` (a parser or an argument group); both default to None (not given)."""
    parser.add_argument(
        "--botorch",
        action="store_true",
        default=None,
        help="search each gbs's strategies by Bayesian optimisation (default: exhaustively when the space "
        "has at most a million strategies, as every CONA model's has, else by BO)",
    )
    parser.add_argument(
        "--exhaustive",
        "--no-botorch",
        dest="no_botorch",
        action="store_true",
        default=None,
        help="evaluate every strategy (exhaustive search) whatever the size of the space",
    )


def botorch_choice(flags: argparse.Namespace | Any) -> bool | None:
    """True (``--botorch``), False (``--exhaustive``) or None (chosen by the size of the space)."""
    botorch, exhaustive = getattr(flags, "botorch", None), getattr(flags, "no_botorch", None)
    if botorch and exhaustive:
        raise UsageError("--botorch and --exhaustive (--no-botorch) contradict each other; give one")
    if botorch:
        return True
    return False if exhaustive else None
