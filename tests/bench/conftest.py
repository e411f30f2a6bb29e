"""Importing the scripts of bench/, which import their siblings and the ttt package from that folder."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def import_bench() -> Iterator[Callable[[str], ModuleType]]:
    """``import_bench("ttt.headroom")``: a script or a package module of bench/, with bench/ on the path
    meanwhile."""
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module
    finally:
        sys.path.remove(str(BENCH))
