"""Argument types for numeric flags: argparse turns their refusal into a usage error that names the flag
(``argument --hysteresis: invalid finite_float value: 'nan'``, exit 2), before anything runs.

Plain ``type=float`` takes ``nan`` and ``inf``, which pass every range check after it (``nan <= 0`` is
false) and then print as results (``cona plan --switch-cost-s nan`` wrote a chain with ``nan s`` costs);
a gbs of 0 sent ``cona plan``'s frontier into an endless loop.
"""

from __future__ import annotations

import argparse
import math

SEED_LIMIT = 2**63
"""Seeds are below this: numpy's seeding takes any non-negative integer, torch's at most 64 bits."""


def finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def seed_value(text: str) -> int:
    value = int(text)
    if not 0 <= value < SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"a seed is from 0 to 2**63 - 1, got {text}")
    return value


def port_base(text: str) -> int:
    """``--master-port-base``: stage N rendezvous on BASE+N and, across nodes, the runners' store on BASE
    itself: an unprivileged port with room for a stage above it. A stage past 65535 is refused when it
    starts (the chain's length is not known here)."""
    value = int(text)
    if not 1024 <= value <= 65534:
        raise argparse.ArgumentTypeError(f"stage N uses port BASE+N: BASE is from 1024 to 65534, got {text}")
    return value
