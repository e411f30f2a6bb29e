"""CONA: train language models under a chain of parallel strategies.

``cona.train`` runs a chain, online strategy chaining or a fixed strategy and returns a ``TrainResult``;
``cona.load_model`` loads a checkpoint as a model (:mod:`cona.api`). They are imported on first use, so
``import cona`` imports neither torch nor the runner.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["Fixed", "Online", "Stage", "TrainResult", "__version__", "load_model", "train"]
_API = frozenset(__all__) - {"__version__"}

if TYPE_CHECKING:
    from cona.api import Fixed, Online, Stage, TrainResult, load_model, train


def __getattr__(name: str) -> Any:
    if name in _API:
        return getattr(importlib.import_module("cona.api"), name)
    raise AttributeError(f"module 'cona' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])
