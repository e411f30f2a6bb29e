"""Local refinement of a search's answer over neighbouring discrete strategies (pure functions).

The Bayesian search (:mod:`cona.planner.search`) ends when its Gaussian process expects no more
improvement; where the GP is confidently wrong, the better strategy is one option away or in a (tp, pp)
layout the bootstrap never saw fit. These functions find such strategies with plain model calls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from cona.strategy import StrategyArray

LAYOUT_COLUMNS = 2
"""The first columns of :func:`option_ranks`: tp and pp."""


class Observations(Protocol):
    """What a search has evaluated: the space indices in order, and its fastest fitting one."""

    indices: list[int]

    def best_fitting(self) -> int | None: ...


def refine_locally(
    space: StrategyArray, observed: Observations, evaluate: Callable[[int], None], max_rounds: int
) -> None:
    """Check the GP's answer around the fastest fitting strategy evaluated so far (the incumbent).

    First a layout sweep: the incumbent's execution options carried over to every other (tp, pp) layout
    (:func:`layout_representatives`). Then a hill climb: evaluate the incumbent's not-yet-evaluated
    neighbours (:func:`neighbours`), move to the fastest fitting one if it beats the incumbent, stop when
    none does or after ``max_rounds`` rounds (0 skips the whole refinement).

    The GP's stop rule trusts its posterior; where it is confidently wrong, the better strategy is either
    one option away (a memory boundary the GP smooths over) or in a layout the bootstrap saw only through a
    strategy that did not fit (with more layouts than bootstrap samples, some are never seen at all). The
    layout decides most of the time, and every check costs one model call, not a GP update.
    """
    if max_rounds == 0 or observed.best_fitting() is None:
        return
    ranks = option_ranks(space)
    evaluate_new(layout_representatives(space, ranks, observed.best_fitting()), observed, evaluate)
    for _ in range(max_rounds):
        incumbent = observed.best_fitting()
        evaluate_new(neighbours(ranks, incumbent), observed, evaluate)
        if observed.best_fitting() == incumbent:
            return


def evaluate_new(indices: np.ndarray, observed: Observations, evaluate: Callable[[int], None]) -> None:
    """Evaluate those of ``indices`` not evaluated yet, in order."""
    seen = set(observed.indices)
    for index in indices:
        if int(index) not in seen:
            evaluate(int(index))


def layout_representatives(space: StrategyArray, ranks: np.ndarray, center: int) -> np.ndarray:
    """For every (tp, pp) layout, the strategy of that layout whose other options are closest to those
    of ``center`` (sum of rank differences; ties: the first in the space), as indices into the space."""
    distance = np.abs(ranks[:, LAYOUT_COLUMNS:] - ranks[center, LAYOUT_COLUMNS:]).sum(axis=1)
    layout = ranks[:, 0] * (int(ranks[:, 1].max()) + 1) + ranks[:, 1]
    order = np.lexsort((distance, layout))
    _, first = np.unique(layout[order], return_index=True)
    return np.sort(order[first])


def option_ranks(space: StrategyArray) -> np.ndarray:
    """Each strategy's free options (tp, pp, mbs, virtual stages, ZeRO stage, recompute, sequence
    parallelism) as ranks among the values the space takes; dp and the micro-batch count follow from them."""
    columns = (
        space.tp,
        space.pp,
        space.mbs,
        space.virtual_stages,
        space.zero_stage,
        space.recompute,
        space.sequence_parallel,
    )
    return np.stack([np.unique(column, return_inverse=True)[1] for column in columns], axis=1)


def neighbours(ranks: np.ndarray, center: int) -> np.ndarray:
    """Strategies one step from ``center`` along one option (the next smaller or larger value of tp, pp,
    mbs, ...), as indices into the space, without ``center``.

    A step can leave the space (tp 1 has no sequence parallelism, a deeper pipeline needs a different virtual
    stage count or more micro-batches): then the valid strategy with that option value that changes the
    other options least (sum of rank differences) stands in for it.
    """
    distance = np.abs(ranks - ranks[center]).sum(axis=1)
    found = set()
    for column in range(ranks.shape[1]):
        for step in (-1, 1):
            on_target = np.flatnonzero(ranks[:, column] == ranks[center, column] + step)
            if len(on_target):
                found.add(int(on_target[np.argmin(distance[on_target])]))
    return np.array(sorted(found), dtype=np.int64)
