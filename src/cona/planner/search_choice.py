"""Which search finds a frontier's best strategy: exhaustively while the space is small enough that one
vectorised model call over it is faster than Bayesian optimisation, by BO above that.

Measured on this project's shared 2-core development machine (``bench/search_speed.py --crossover 5``,
docs/benchmarks.md "Search speed"): the exhaustive search of the spaces CONA's models produce (1,914 to
36,456 candidates, GPT 350M to 175B on 8 to 8,192 GPUs) took 3 to 39 ms; the Bayesian search of the same
spaces 2.3 to 20 s, for the same best strategy or one up to 4% slower, and 3.0 to 61 s (median 7.2 s) on 5
random frontiers. The vectorised model call costs about 2 us a candidate at 100k candidates and 3 to 4.4 us
at 1M (2.9 to 4.4 s in all, as long as the fastest BO search), so exhaustive search is the faster one up to
about a million candidates.
"""

from __future__ import annotations

from typing import Any

from cona.config import ModelConfig
from cona.planner import search
from cona.planner.search import SearchResult
from cona.planner.space import enumerate_strategies
from cona.planner.systems import System

EXHAUSTIVE_UP_TO = 1_000_000
"""Largest space (valid strategies before the memory check) searched exhaustively when no search is
forced; a larger one is searched by BO. See the module docstring for the measurement."""


def uses_botorch(space_size: int, botorch: bool | None) -> bool:
    """``botorch`` when forced (True: BO, False: exhaustive), else BO only above :data:`EXHAUSTIVE_UP_TO`."""
    return botorch if botorch is not None else space_size > EXHAUSTIVE_UP_TO


def search_strategies(
    model: ModelConfig,
    system: System,
    n_gpus: int,
    gbs: int,
    *,
    botorch: bool | None = None,
    seed: int = 0,
    **settings: Any,
) -> SearchResult:
    """The best strategies of ``gbs`` on ``n_gpus`` by the search :func:`uses_botorch` picks; ``settings``
    are those both searches take (options, dtype, calibration, top_k, backend), ``seed`` the BO's."""
    if botorch is None:
        # Enumerating alone is cheap (about 1 ms for 10k candidates); the exhaustive search repeats it.
        space = enumerate_strategies(
            model, n_gpus, gbs, gpus_per_node=system.gpus_per_node, options=settings.get("options")
        )
        botorch = uses_botorch(len(space), None)
    if botorch:
        return search.bayesian_search(model, system, n_gpus, gbs, seed=seed, **settings)
    return search.exhaustive_search(model, system, n_gpus, gbs, **settings)
