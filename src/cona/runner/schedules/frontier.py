"""The online search's frontier: the best strategy of a global batch size (every one the planner proposes is
engine-valid: :mod:`cona.layout_rules`) and the throughput the decisions should expect of it
(:class:`cona.planner.throughput.ThroughputEstimator` over the run's measured points)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from cona.config import ConaConfig, ModelConfig
from cona.errors import PlanError
from cona.metrics_record import MetricsRecord
from cona.planner.plan import space_options
from cona.planner.policy import Candidate
from cona.planner.profiles import run_profile
from cona.planner.search_choice import search_strategies
from cona.planner.systems import System
from cona.planner.throughput import (
    Point,
    StepParts,
    ThroughputEstimator,
    fit_shape,
    fitted_forms,
    model_step_parts,
)
from cona.strategy import Strategy, configured_strategy, noise_step_pieces

if TYPE_CHECKING:
    from cona.engine.host_steps import HostStep

PROBED_MICRO_BATCHES = (1, 2)
"""The micro-batch sizes a CPU run's prior is fitted on: two shapes of the host's step."""


class FrontierSearch:
    """The best strategy of a gbs and its expected throughput: the search ranks by the raw model
    (cached per gbs: the model does not change), then its top strategies are re-ranked by the run's
    :class:`ThroughputEstimator` (measured where measured, else the model corrected in shape on every
    measured point)."""

    def __init__(
        self,
        *,
        config: ConaConfig,
        system: System,
        n_gpus: int,
        dtype: str,
        botorch: bool | None = None,
        top_k: int = 16,
        backend: str = "native",
    ) -> None:
        """``backend``: whose performance profile predicts the strategies (``cona.planner.profiles``)."""
        self.config, self.system, self.n_gpus, self.dtype = config, system, n_gpus, dtype
        self.botorch, self.top_k, self.backend = botorch, top_k, backend
        self.profile = run_profile(backend, config.training)
        self.options = space_options(config.training)
        self.estimator = ThroughputEstimator(seq=config.model.seq, forms=fitted_forms(system, self.profile))
        self._cache: dict[int, tuple[list[Strategy], StepParts | None]] = {}

    def add_measurement(
        self,
        strategy: Strategy,
        tokens_per_s: float,
        *,
        intervals: int = 1,
        source: str = "",
        proxy: bool = False,
    ) -> None:
        """A measured throughput (``intervals`` log intervals; one from the same ``source`` replaces the
        last) joins the estimator, which refits its shape on every point (``proxy``: see
        :attr:`cona.planner.throughput.Point.proxy`)."""
        point = Point(
            strategy=strategy,
            tokens_per_s=tokens_per_s,
            model=self.model_step(strategy),
            intervals=intervals,
            source=source,
            proxy=proxy,
        )
        self.estimator = self.estimator.with_point(point)

    def add_first_line(self, record: MetricsRecord, strategy: Strategy, *, source: str) -> bool:
        """The steps of a stage's first line after its first step as a proxy point of ``strategy`` (the
        line the first decision is made at, before any steady line), where they ran the strategy's own
        step shape: they show this host's speed, which the prior cannot know (on a 2-core CPU the demo's
        first strategy runs at 1/16 of its prior). Not where those steps measured the noise scale as pieces
        of the micro-batch (:func:`cona.strategy.noise_step_pieces`): such a line warms up the pieces' new
        shape and runs the noise hooks, and can take 4x a whole step's time (eager GPT-125M at gbs 8). Nor
        where a
        step after the first still warmed up a shape. Returns whether a point was added."""
        rest_s = record.after_first_step_s
        if rest_s is None or self.profile.name != "native" or (record.warmup_steps or 0) > 1:
            return False
        if noise_step_pieces(strategy) > 1 and record.measured_steps > 0:
            return False
        tokens_per_s = strategy.gbs * self.config.model.seq / rest_s
        self.add_measurement(strategy, tokens_per_s, source=source, proxy=True)
        return True

    def fit_prior(self, steps: list[HostStep], *, world_size: int, cores: int, threads: int) -> str:
        """Fit the prior (the shape the estimator predicts with until the run measures a strategy) on a CPU
        host's timed steps of the whole model (:func:`cona.engine.host_steps.time_host_steps`, one process
        with ``threads`` threads), each taken as a one-process strategy of that micro-batch whose worker
        gets its share of the ``cores`` the run's ``world_size`` workers divide; returns the line that says
        so."""
        share = min(1.0, cores / (world_size * threads))
        strategies = [
            configured_strategy(
                self.config.training, dp=1, tp=1, pp=1, mbs=step.micro_batch, gbs=step.micro_batch
            )
            for step in steps
        ]
        seconds = [step.seconds / share for step in steps]
        shape = fit_shape(self.model_steps(strategies), seconds, self.estimator.forms)
        self.estimator = dataclasses.replace(self.estimator, shape=shape)
        timed = ", ".join(f"mbs {step.micro_batch} {step.seconds * 1e3:.1f} ms" for step in steps)
        return (
            f"prior fitted to this host: the model's step timed at {timed} (1 process, {threads} thread"
            f"{'s' if threads != 1 else ''}), each worker taken at {share:.2g} of that speed ({world_size} "
            f"workers on {cores} cores)"
        )

    def model_steps(self, strategies: list[Strategy]) -> StepParts:
        """The raw model's steps of ``strategies`` in the parts the estimator corrects."""
        return model_step_parts(self.config.model, strategies, self.system, self.dtype, backend=self.profile)

    def model_step(self, strategy: Strategy) -> StepParts:
        return self.model_steps([strategy])

    def model_step_s(self, strategy: Strategy) -> float:
        """The raw model's device seconds of one strategy."""
        return float(self.model_step(strategy).device_s[0])

    def predicted_tokens_per_s(self, strategy: Strategy) -> float:
        """The estimator's throughput of one strategy (its measured value when it has one)."""
        return self.estimator.estimate(strategy, self.model_step(strategy)).tokens_per_s

    def __call__(self, gbs: int) -> Candidate | None:
        if gbs not in self._cache:
            self._cache[gbs] = self._search(gbs)
        strategies, models = self._cache[gbs]
        if models is None:
            return None
        best = self.estimator.ranked(strategies, models)[0]
        return Candidate(
            strategy=best.strategy,
            predicted_tokens_per_s=best.tokens_per_s,
            throughput_source=best.source,
            fitted_on=best.fitted_on,
            on_first_line=best.on_first_line,
        )

    def _search(self, gbs: int) -> tuple[list[Strategy], StepParts | None]:
        """The model's ``top_k`` strategies of ``gbs`` with their raw model steps in parts (None: none)."""
        try:
            result = search_strategies(
                self.config.model,
                self.system,
                self.n_gpus,
                gbs,
                options=self.options,
                dtype=self.dtype,
                top_k=self.top_k,
                botorch=self.botorch,
                backend=self.profile,
            )
        except PlanError:
            return [], None  # nothing valid or fitting at this gbs: the frontier skips it
        # Every candidate of the space is one the engine trains (the space applies cona.layout_rules).
        strategies = [result.candidates[row] for row in range(len(result.candidates))]
        return (strategies, self.model_steps(strategies)) if strategies else ([], None)


def fit_prior_on_host(frontier: FrontierSearch, model: ModelConfig, processes_per_node: int) -> str:
    """Time the model's step on this host's CPU and fit the frontier's prior on it (a CPU run, before its
    first stage is chosen); returns the line that says so."""
    from cona.engine.host_steps import time_host_steps  # imports torch
    from cona.runner.launch import usable_cores

    cores = usable_cores()
    threads = max(1, cores // processes_per_node)  # what each worker gets (cona.runner.launch.worker_env)
    steps = time_host_steps(model, PROBED_MICRO_BATCHES, threads=threads)
    return frontier.fit_prior(steps, world_size=processes_per_node, cores=cores, threads=threads)
