"""Find the fastest strategy for N GPUs at one global batch size: exhaustively, or by Bayesian optimisation.

Both score strategies with the performance model's predicted iteration time (a fixed ``gbs``, so the
fastest iteration is the highest throughput) and keep only strategies that fit in memory. The exhaustive
search makes one vectorised model call over the whole space. The Bayesian search (as in CONA's original, where
one Calculon evaluation cost milliseconds of Python) evaluates one strategy per model call and counts the
calls: a Gaussian process on a numeric encoding of the strategy, and expected improvement evaluated on every
not-yet-evaluated candidate of the discrete space (no continuous optimisation, so every proposal is a valid
strategy), then a local refinement around the best strategy found (a layout sweep and a hill climb over
neighbouring strategies) that catches where the GP was confidently wrong.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

from cona.config import ModelConfig
from cona.errors import PlanError
from cona.planner.local_search import refine_locally
from cona.planner.perf_model import Prediction, predict
from cona.planner.profiles import BackendProfile
from cona.planner.search_gp import Observations, gp_updates
from cona.planner.space import SpaceOptions, enumerate_strategies
from cona.planner.systems import System
from cona.strategy import Strategy, StrategyArray

if TYPE_CHECKING:
    from cona.planner.calibration_factors import Calibration

BOOTSTRAP_SAMPLES = 10
"""Random strategies evaluated before the first Gaussian-process fit, one per (tp, pp) layout first
(see :func:`bootstrap_order`)."""
EI_STOP_FRACTION = 0.001
"""Stop when the largest expected improvement is below this fraction of the best throughput found (EI is
computed on log throughput, so an EI of ``log(1 + f)`` is an expected ``f`` relative gain). 0.01 stopped
too early: on 12 random frontiers, half of the searches ended more than 2% from the optimum."""
MAX_GP_UPDATES = 60
"""Most Gaussian-process updates (one new evaluation each) after the bootstrap."""
MAX_LOCAL_ROUNDS = 10
"""Most hill-climbing rounds of the refinement that follows the GP phase (:func:`refine_locally`): each
round evaluates the incumbent's not-yet-evaluated neighbours and moves to the best one if it is faster;
0 turns the refinement off."""

GP_THREADS = 1
"""Torch threads while fitting: a GP on tens of points gains nothing from threads, and on a shared machine
they cost seconds per fit in synchronisation."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchResult:
    """Ranked strategies (fastest first), all fitting in memory, with their predictions."""

    method: Literal["exhaustive", "bayesian"]
    candidates: StrategyArray
    prediction: Prediction
    """Rows aligned with ``candidates``."""
    evaluations: int
    """Strategies the performance model evaluated to find them."""
    space_size: int
    """Valid strategies in the space searched (before the memory check)."""
    evaluated: StrategyArray | None = None
    """Bayesian search: every strategy it evaluated, in evaluation order (None for the exhaustive search)."""
    refinement_evaluations: int = 0
    """Bayesian search: how many of the evaluations (the last ones) the local refinement made."""

    @property
    def best(self) -> Strategy:
        return self.candidates[0]


def exhaustive_search(
    model: ModelConfig,
    system: System,
    n_gpus: int,
    gbs: int,
    *,
    options: SpaceOptions | None = None,
    dtype: str = "bf16",
    calibration: Calibration | None = None,
    top_k: int = 10,
    backend: str | BackendProfile = "native",
) -> SearchResult:
    """Evaluate every strategy of the space in one vectorised model call and rank those that fit, as
    ``backend`` (:data:`cona.planner.profiles.BACKENDS`) would run them."""
    space = enumerate_strategies(model, n_gpus, gbs, gpus_per_node=system.gpus_per_node, options=options)
    prediction = predict(model, space, system, dtype=dtype, calibration=calibration, backend=backend)
    fits = np.flatnonzero(~prediction.oom)
    if len(fits) == 0:
        _raise_nothing_fits(system, n_gpus, gbs, prediction.memory_gib)
    ranked = fits[np.lexsort((prediction.memory_gib[fits], prediction.iteration_time_s[fits]))][:top_k]
    return SearchResult(
        method="exhaustive",
        candidates=space.select(ranked),
        prediction=select_rows(prediction, ranked, len(space)),
        evaluations=len(space),
        space_size=len(space),
    )


def bayesian_search(
    model: ModelConfig,
    system: System,
    n_gpus: int,
    gbs: int,
    *,
    options: SpaceOptions | None = None,
    dtype: str = "bf16",
    calibration: Calibration | None = None,
    top_k: int = 10,
    seed: int = 0,
    bootstrap_samples: int = BOOTSTRAP_SAMPLES,
    ei_stop_fraction: float = EI_STOP_FRACTION,
    max_gp_updates: int = MAX_GP_UPDATES,
    max_local_rounds: int = MAX_LOCAL_ROUNDS,
    backend: str | BackendProfile = "native",
) -> SearchResult:
    """BoTorch search over the same space, then a local refinement; deterministic for a given ``seed``.

    Two GP outputs on the strategy encoding: log throughput (``-log`` iteration time, known for every
    evaluated strategy, fitting or not) and log memory per GPU; the acquisition is expected improvement of the
    first times the probability that the second is under the memory limit (constrained EI). When EI says
    nothing is worth evaluating (or the update budget is spent), :func:`refine_locally` checks the layouts
    and the neighbouring strategies of the best one found, where the GP may be confidently wrong.
    """
    torch = _import_botorch_stack()
    if bootstrap_samples < 1 or max_gp_updates < 0 or ei_stop_fraction < 0 or max_local_rounds < 0:
        raise PlanError(
            "BO settings: bootstrap samples must be >= 1, GP updates, local rounds and EI stop fraction >= 0"
        )
    space = enumerate_strategies(model, n_gpus, gbs, gpus_per_node=system.gpus_per_node, options=options)
    observed = Observations()
    predicted = functools.partial(
        _predict_for, model, system=system, dtype=dtype, calibration=calibration, backend=backend
    )

    def evaluate(index: int) -> None:
        row = predicted(space.select(np.array([index])))
        observed.add(index, float(row.iteration_time_s[0]), float(row.memory_gib[0]), bool(row.oom[0]))

    rng = np.random.default_rng(seed)
    for index in bootstrap_order(space, rng)[:bootstrap_samples]:
        evaluate(int(index))
    # perf_model's rule: out of memory when memory_gib + reserved exceeds the GPU's memory.
    log_memory_limit = math.log(max(system.gpu.memory_gib - system.gpu.reserved_gib, 1e-9))
    with torch.random.fork_rng(), _torch_threads(GP_THREADS):
        torch.manual_seed(seed)
        gp_updates(encode(space), observed, evaluate, log_memory_limit, ei_stop_fraction, rng, max_gp_updates)
    global_evaluations = len(observed.indices)
    refine_locally(space, observed, evaluate, max_local_rounds)
    result = _ranked_result(predicted, system, space, observed, top_k, n_gpus, gbs)
    return dataclasses.replace(result, refinement_evaluations=len(observed.indices) - global_evaluations)


def _import_botorch_stack():
    """torch, after checking that BoTorch is importable (deferred: the rest of the planner needs neither)."""
    try:
        import botorch  # noqa: F401
        import torch
    except ImportError:
        raise PlanError(
            "the Bayesian search needs BoTorch: pip install 'cona[search]', or use the exhaustive search "
            "(--no-botorch)"
        ) from None
    return torch


def bootstrap_order(space: StrategyArray, rng: np.random.Generator) -> np.ndarray:
    """A random order of the space in which one strategy of every (tp, pp) layout comes first.

    The layout decides most of the time (bubble, communication, per-GPU work), and uniform draws mostly land
    in the layouts with the most execution options (deep pipelines with many interleavings): stratifying the
    first draws by layout lets the GP see every part of the space before it extrapolates.
    """
    order = rng.permutation(len(space))
    layout = space.tp[order] * (int(space.pp.max()) + 1) + space.pp[order]
    _, first = np.unique(layout, return_index=True)
    representatives = np.sort(first)
    rest = np.setdiff1d(np.arange(len(order)), representatives, assume_unique=True)
    return order[np.concatenate([representatives, rest])]


@contextmanager
def _torch_threads(count: int) -> Iterator[None]:
    """Run with ``count`` torch threads, then restore the previous setting."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def encode(strategies: StrategyArray) -> np.ndarray:
    """Numeric features of each strategy in [0, 1]: log2 of the degrees, micro-batch size, micro-batch count
    and virtual stages, then ZeRO stage, recompute mode and sequence parallelism.

    dp and the micro-batch count are functions of the others (N and gbs are fixed) but enter the time
    directly (DP all-reduce size, pipeline bubble ``(pp - 1) / (v m)``), so giving them to the GP makes its
    job easier. Each column is scaled by its range over the candidate set (a constant column becomes 0), so
    the GP's length scales are comparable.
    """
    micro_batches = strategies.gbs // (strategies.mbs * strategies.dp)
    columns = np.stack(
        [
            np.log2(strategies.dp),
            np.log2(strategies.tp),
            np.log2(strategies.pp),
            np.log2(strategies.mbs),
            np.log2(micro_batches),
            np.log2(strategies.virtual_stages),
            strategies.zero_stage,
            strategies.recompute,
            strategies.sequence_parallel,
        ],
        axis=1,
    ).astype(np.float64)
    low, span = columns.min(axis=0), np.ptp(columns, axis=0)
    return (columns - low) / np.where(span > 0, span, 1.0)


def _predict_for(model: ModelConfig, strategies: StrategyArray, **settings) -> Prediction:
    """:func:`predict` with the strategies second, for binding everything else once."""
    return predict(model, strategies, settings.pop("system"), **settings)


def _ranked_result(
    predicted: Callable[[StrategyArray], Prediction],
    system: System,
    space: StrategyArray,
    observed: Observations,
    top_k: int,
    n_gpus: int,
    gbs: int,
) -> SearchResult:
    indices, times, memory = (np.asarray(v) for v in (observed.indices, observed.times, observed.memory))
    fits = ~np.asarray(observed.oom)
    if not fits.any():
        _raise_nothing_fits(system, n_gpus, gbs, memory, searched="of the strategies the search evaluated ")
    order = np.lexsort((memory[fits], times[fits]))[:top_k]
    best = space.select(indices[fits][order])
    # One vectorised call for the winners' full prediction rows (already evaluated: not counted again).
    prediction = predicted(best)
    return SearchResult(
        method="bayesian",
        candidates=best,
        prediction=prediction,
        evaluations=len(indices),
        space_size=len(space),
        evaluated=space.select(indices),
    )


def select_rows(prediction: Prediction, rows: np.ndarray, count: int) -> Prediction:
    """The prediction restricted to ``rows`` (every per-strategy array field; other fields kept)."""
    changes = {}
    for field in dataclasses.fields(prediction):
        value = getattr(prediction, field.name)
        if isinstance(value, np.ndarray) and value.ndim >= 1 and value.shape[0] == count:
            changes[field.name] = value[rows]
    return dataclasses.replace(prediction, **changes)


def _raise_nothing_fits(
    system: System, n_gpus: int, gbs: int, memory_gib: np.ndarray, searched: str = ""
) -> None:
    raise PlanError(
        f"no strategy {searched}for {n_gpus} GPUs at gbs {gbs} fits in the memory of {system.name} "
        f"({system.gpu.memory_gib:g} GiB per GPU): the smallest needs {float(np.min(memory_gib)):.1f} GiB; "
        "use more GPUs, allow more ZeRO stages or recomputation, or a smaller model"
    )
