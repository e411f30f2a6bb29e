"""The Gaussian-process half of the Bayesian search (:func:`cona.planner.search.bayesian_search`): what it
has evaluated, the constrained expected-improvement proposals and their GP fits.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

GP_FIT_STEPS = 60
"""L-BFGS steps of one GP hyperparameter fit (warm-started from the previous fit)."""
GP_REFIT_GROWTH = 1.2
"""Refit the GP hyperparameters once the observations have grown by this factor since the last fit."""


@dataclass(slots=True)
class Observations:
    """What the search has evaluated so far (one entry per model call), in evaluation order."""

    indices: list[int] = dataclasses.field(default_factory=list)
    times: list[float] = dataclasses.field(default_factory=list)
    memory: list[float] = dataclasses.field(default_factory=list)
    oom: list[bool] = dataclasses.field(default_factory=list)

    def add(self, index: int, time: float, memory: float, oom: bool) -> None:
        self.indices.append(index)
        self.times.append(time)
        self.memory.append(memory)
        self.oom.append(oom)

    def best_fitting(self) -> int | None:
        """Space index of the fastest evaluated strategy that fits (None when none fits)."""
        rows = zip(self.times, self.memory, self.indices, self.oom, strict=True)
        fitting = [(time, memory, index) for time, memory, index, oom in rows if not oom]
        return min(fitting)[2] if fitting else None


@dataclass(frozen=True, kw_only=True, slots=True)
class _Hyperparameters:
    """A fitted GP's hyperparameters and the number of observations they were fitted on."""

    state: dict
    fitted_on: int


def _propose(
    features: np.ndarray,
    observed: Observations,
    log_memory_limit: float,
    ei_stop_fraction: float,
    rng: np.random.Generator,
    hyperparameters: _Hyperparameters | None,
) -> tuple[int | None, _Hyperparameters | None]:
    """The unevaluated candidate of largest constrained EI (None when none is worth evaluating), and the GP
    hyperparameters used, for the next proposal."""
    import torch
    from botorch.acquisition.analytic import LogConstrainedExpectedImprovement

    pending = np.setdiff1d(np.arange(len(features)), np.asarray(observed.indices))
    log_throughput = -np.log(np.asarray(observed.times))
    if np.ptp(log_throughput) == 0.0:  # every evaluation alike: nothing to learn from yet, explore
        return int(rng.choice(pending)), hyperparameters
    try:
        gp, hyperparameters = _surrogate(features, observed, log_throughput, hyperparameters)
    except (RuntimeError, ValueError):  # a numerically failed fit (e.g. not positive definite): explore
        return int(rng.choice(pending)), None
    fits = ~np.asarray(observed.oom)
    # Until something fits, improving on the worst time seen is easy: the acquisition is then mostly the
    # probability of fitting, which leads the search into the feasible region.
    best = float(log_throughput[fits].max()) if fits.any() else float(log_throughput.min())
    acquisition = LogConstrainedExpectedImprovement(
        gp, best_f=best, objective_index=0, constraints={1: (None, log_memory_limit)}
    )
    with torch.no_grad():
        log_ei = acquisition(torch.as_tensor(features[pending], dtype=torch.float64).unsqueeze(1)).numpy()
    chosen = int(np.argmax(log_ei))
    # The objective is log throughput, so EI is a relative gain; keep searching while nothing fits yet.
    if fits.any() and log_ei[chosen] < math.log(math.log1p(ei_stop_fraction)):
        return None, hyperparameters
    return int(pending[chosen]), hyperparameters


def _surrogate(
    features: np.ndarray,
    observed: Observations,
    log_throughput: np.ndarray,
    hyperparameters: _Hyperparameters | None,
):
    """A two-output GP (log throughput, log memory) on the observations, in eval mode.

    Its hyperparameters are refitted only when the observations have grown by :data:`GP_REFIT_GROWTH` since
    the last fit (warm-started from it); in between the GP conditions on the new data with the previous ones.
    Fitting is most of a proposal's cost, and hyperparameters move little from one point to the next.
    """
    import torch
    from botorch.models import SingleTaskGP
    from botorch.models.transforms.outcome import Standardize
    from botorch.optim.fit import fit_gpytorch_mll_scipy
    from gpytorch.mlls import ExactMarginalLogLikelihood

    targets = np.stack([log_throughput, np.log(np.asarray(observed.memory))], axis=1)
    train_x = torch.as_tensor(features[observed.indices], dtype=torch.float64)
    gp = SingleTaskGP(train_x, torch.as_tensor(targets), outcome_transform=Standardize(m=2))
    count = len(observed.indices)
    if hyperparameters is not None:
        gp.load_state_dict(hyperparameters.state, strict=False)
    if hyperparameters is None or count >= GP_REFIT_GROWTH * hyperparameters.fitted_on:
        # One L-BFGS run, no random restarts: botorch's fit_gpytorch_mll retries from sampled
        # hyperparameters whenever the step limit is hit, which costs seconds per proposal.
        fit_gpytorch_mll_scipy(
            ExactMarginalLogLikelihood(gp.likelihood, gp), options={"maxiter": GP_FIT_STEPS}
        )
        state = {
            key: value for key, value in gp.state_dict().items() if not key.startswith("outcome_transform")
        }
        hyperparameters = _Hyperparameters(state=state, fitted_on=count)
    gp.eval()
    return gp, hyperparameters


def gp_updates(
    features: np.ndarray,
    observed: Observations,
    evaluate: Callable[[int], None],
    log_memory_limit: float,
    ei_stop_fraction: float,
    rng: np.random.Generator,
    max_updates: int,
) -> None:
    """Evaluate what constrained EI proposes, refitting the GPs after each, until it proposes nothing, the
    whole space is evaluated or ``max_updates`` are spent."""
    hyperparameters: _Hyperparameters | None = None
    for _ in range(max_updates):
        if len(observed.indices) == len(features):
            return
        proposal, hyperparameters = _propose(
            features, observed, log_memory_limit, ei_stop_fraction, rng, hyperparameters
        )
        if proposal is None:
            return
        evaluate(proposal)
