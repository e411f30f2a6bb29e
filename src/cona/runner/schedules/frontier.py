"""The online search's frontier: the best strategy of a global batch size (every one the planner proposes is
engine-valid: :mod:`cona.layout_rules`) and the throughput the decisions should expect of it
(:class:`cona.planner.throughput.ThroughputEstimator` over the run's measured points)."""

from __future__ import annotations

from cona.config import ConaConfig
from cona.errors import PlanError
from cona.metrics_record import MetricsRecord
from cona.planner.plan import space_options
from cona.planner.policy import Candidate
from cona.planner.profiles import run_profile
from cona.planner.search_choice import search_strategies
from cona.planner.systems import System
from cona.planner.throughput import Point, StepParts, ThroughputEstimator, fitted_forms, model_step_parts
from cona.strategy import Strategy, noise_step_pieces


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
