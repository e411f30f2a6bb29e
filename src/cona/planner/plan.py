"""Offline planning on a recorded trace: static strategies, the hindsight-optimal chain, CONA's chain.

Training progress is counted in base-batch-equivalent tokens: a token at global batch ``M`` advances training
by the statistical efficiency ``(phi + M0) / (phi + M)``. The noise scale ``phi`` is a function of how far
training has got, so the trace's noise scale is re-indexed by the progress the trace itself had made, and
every chain is simulated on that axis: the time to a target is the time to accumulate the progress the trace
needed to reach it. The progress range is cut into equal segments; within a segment the noise scale is the
one the tracker reported at its start (what an online policy could know), and strategy ``j`` takes
``progress / (tokens_per_s_j x efficiency_j)`` seconds over it. Switching costs ``switch_cost_s`` seconds.

Compared over the same candidates (the best strategy of each gbs of the frontier, by predicted iteration
time): every static strategy (the paper's baselines), the hindsight optimum (dynamic programming over
(segment, candidate) with the switch cost on every change, starting from any candidate), and CONA's online
chain (:func:`policy.decide` at segment boundaries at most once per log interval, as a run decides at its
metrics lines, seeing only the past, from the initial gbs).
Throughputs are the trace's measured ones where it trained a candidate, else the model's corrected in shape on
those measurements (:mod:`cona.planner.throughput`, as online mode does), for all of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from cona.config import ConaConfig, TrainingConfig
from cona.errors import PlanError
from cona.planner.calibration_factors import Calibration
from cona.planner.chains import NoiseProfile, chain_time, optimal_assignment, raw_tokens, segment_times
from cona.planner.policy import (
    Candidate,
    Decision,
    Measurement,
    PolicySettings,
    after_switch,
    decide,
    initial_state,
    next_frontier,
    next_gbs,
)
from cona.planner.probe_replay import lost_s, probes_lost_s, replayed_outcome
from cona.planner.probe_rule import ProbeOutcome
from cona.planner.profiles import BackendProfile
from cona.planner.search_choice import search_strategies
from cona.planner.space import SpaceOptions
from cona.planner.systems import System
from cona.planner.throughput import ThroughputEstimator, model_step_parts
from cona.planner.trace import Trace
from cona.planner.trace_progress import noise_profile, progress_at_tokens
from cona.strategy import Strategy

DEFAULT_SEGMENTS = 400


@dataclass(frozen=True, kw_only=True)
class Stage:
    """A run of one strategy in a chain."""

    strategy: Strategy
    iterations: int
    tokens: float
    time_s: float


@dataclass(frozen=True, kw_only=True)
class ChainPlan:
    """One way to train to the target: the candidate index per segment and what it costs."""

    name: str
    assignment: np.ndarray
    time_s: float
    stages: tuple[Stage, ...]

    @property
    def switches(self) -> int:
        return len(self.stages) - 1


@dataclass(frozen=True, kw_only=True)
class PlanResult:
    candidates: tuple[Candidate, ...]
    static: tuple[ChainPlan, ...]
    """One per candidate, in candidate order."""
    optimum: ChainPlan
    online: ChainPlan
    decisions: tuple[dict, ...]
    """CONA's switch and fallback decision records."""
    target_progress: float
    switch_cost_s: float

    @property
    def best_static(self) -> ChainPlan:
        return min(self.static, key=lambda plan: plan.time_s)

    @property
    def worst_static(self) -> ChainPlan:
        return max(self.static, key=lambda plan: plan.time_s)


def frontier_sizes(initial_gbs: int, settings: PolicySettings) -> list[int]:
    """``initial_gbs`` and every frontier after it, up to ``settings.max_gbs``."""
    sizes = [initial_gbs]
    while (size := next_gbs(sizes[-1], settings)) is not None:
        sizes.append(size)
    return sizes


def space_options(training: TrainingConfig) -> SpaceOptions:
    """What a chain file can express: a step gives dp/tp/pp/mbs/gbs, the other options are the config's.

    GPipe configs are searched (and predicted) as 1F1B, which has the same bubble. Interleaved 1F1B is
    refused: a chain gives every step the config's virtual stages, which a pp = 1 step cannot have, and the
    space cannot be limited to exactly that many."""
    if (
        training.runtime.pipeline_schedule == "interleaved_1f1b"
        and training.runtime.pipeline_virtual_stages > 1
    ):
        raise PlanError(
            "training.pipeline_schedule: planning chains for 'interleaved_1f1b' is not supported; "
            "plan with '1f1b' (the chain's strategies are the same apart from the schedule)"
        )
    return SpaceOptions(
        zero_stages=(training.runtime.zero_stage,),
        recompute=(training.runtime.recompute,),
        sequence_parallel=(training.runtime.sequence_parallel,),
        interleave=False,
    )


@dataclass(frozen=True, kw_only=True)
class SearchSettings:
    """How the best strategy of each frontier gbs is found."""

    system: System
    n_gpus: int
    dtype: str = "bf16"
    options: SpaceOptions | None = None
    calibration: Calibration | None = None
    botorch: bool | None = None
    """True: Bayesian optimisation, False: exhaustive, None: chosen by the size of the space
    (:func:`cona.planner.search_choice.uses_botorch`)."""
    backend: str | BackendProfile = "native"
    """The backend whose profile predicts the strategies (:data:`cona.planner.profiles.BACKENDS`)."""
    estimator: ThroughputEstimator | None = None
    """The trace's measured throughputs and the shape fitted on them (as online mode uses them): the
    model's top strategies are re-ranked by it, and a measured one is taken at its measured rate."""


RERANKED = 16
"""Strategies of the model's ranking that an estimator re-ranks (as online mode's FrontierSearch does)."""


def best_candidate(config: ConaConfig, gbs: int, search: SearchSettings) -> Candidate:
    """The fastest strategy at ``gbs`` that fits, with its expected throughput (PlanError when none fits)."""
    result = search_strategies(
        config.model,
        search.system,
        search.n_gpus,
        gbs,
        options=search.options,
        dtype=search.dtype,
        calibration=None if search.estimator is not None else search.calibration,
        top_k=1 if search.estimator is None else RERANKED,
        backend=search.backend,
        botorch=search.botorch,
    )
    if search.estimator is None:
        return Candidate(
            strategy=result.best, predicted_tokens_per_s=float(result.prediction.tokens_per_s[0])
        )
    strategies = [result.candidates[row] for row in range(len(result.candidates))]
    models = model_step_parts(config.model, strategies, search.system, search.dtype, backend=search.backend)
    best = search.estimator.ranked(strategies, models)[0]
    return Candidate(
        strategy=best.strategy,
        predicted_tokens_per_s=best.tokens_per_s,
        throughput_source=best.source,
        fitted_on=best.fitted_on,
    )


def best_candidates(config: ConaConfig, sizes: list[int], search: SearchSettings) -> tuple[Candidate, ...]:
    """The fastest strategy of each gbs (a gbs where nothing fits is left out; the first must fit)."""
    candidates = []
    for gbs in sizes:
        try:
            candidates.append(best_candidate(config, gbs, search))
        except PlanError:
            if gbs == sizes[0]:
                raise
    return tuple(candidates)


def online_assignment(
    profile: NoiseProfile,
    candidates: tuple[Candidate, ...],
    settings: PolicySettings,
    *,
    switch_cost_s: float,
    seq: int,
    believed: tuple[Candidate, ...] | None = None,
    measure: Callable[[int, int], float] | None = None,
    probes: tuple[ProbeOutcome, ...] = (),
) -> tuple[np.ndarray, tuple[dict, ...]]:
    """CONA's chain: :func:`decide` at a segment boundary on what is known there, starting at the first
    candidate, once ``settings.decision_interval`` iterations have run since the last decision (as a run
    decides at its metrics lines: a short trace's segments are fractions of an iteration); the frontier
    is :func:`next_frontier` over the candidates (in increasing gbs order). ``candidates`` hold the true
    throughputs (what the running strategy is measured at); ``believed`` the same strategies with the
    throughputs the policy is told for the frontier (default: the true ones), to test a model's error;
    ``measure(segment, index)`` what the running candidate is measured at (default: its throughput in
    ``candidates``, exactly); ``probes`` the run's recorded probes (:func:`answer_probe`). Returns the
    assignment and the records of the probe, switch and fallback decisions."""
    believed = believed or candidates
    times = segment_times(profile, candidates, settings.base_gbs)
    tokens = raw_tokens(profile, candidates, settings.base_gbs)
    index_of = {candidate.strategy: index for index, candidate in enumerate(candidates)}
    by_gbs = {candidate.strategy.gbs: candidate for candidate in believed}
    current, state = 0, initial_state(believed[0])
    clock, consumed, iteration, decided_at = 0.0, 0.0, 0.0, 0.0
    assignment = np.empty(len(profile.estimates), dtype=np.int64)
    decisions = []
    for k in range(len(profile.estimates)):
        if k > 0 and iteration - decided_at >= settings.decision_interval:
            decided_at = iteration
            running = candidates[current]
            measured = running.predicted_tokens_per_s if measure is None else measure(k, current)
            counts = (clock, int(iteration), int(consumed), measured)
            measurement = _measurement(profile, k, running.strategy.gbs, settings.base_gbs, counts)
            frontier = next_frontier(running.strategy.gbs, measured, settings, by_gbs.get)
            decision = decide(state, measurement, frontier, settings)
            if decision.action == "probe" and frontier is not None:
                pair = (current, index_of[frontier.strategy])
                answer = answer_probe(decision, measurement, settings, probes, candidates, times[k], pair)
                decision, spent_s, records = answer
                clock += spent_s
                decisions += records
            state = decision.state
            if decision.target is not None:
                decisions.append(decision.record)
                current = index_of[decision.target.strategy]
                state = after_switch(
                    state,
                    new=decision.target,
                    old_measured_tokens_per_s=measured,
                    switch_cost_s=switch_cost_s,
                )
                clock += switch_cost_s
        assignment[k] = current
        clock += times[k, current]
        consumed += tokens[k, current]
        iteration += tokens[k, current] / (candidates[current].strategy.gbs * seq)
    return assignment, tuple(decisions)


def _measurement(
    profile: NoiseProfile, segment: int, gbs: int, base_gbs: int, counts: tuple[float, int, int, float]
) -> Measurement:
    """What a run at ``gbs`` knows at ``segment``'s start; ``counts``: its clock, iteration, consumed tokens
    and measured tokens/s."""
    clock, iteration, consumed, measured = counts
    return Measurement(
        time=clock,
        iteration=iteration,
        consumed_tokens=consumed,
        noise=profile.estimates[segment],
        measured_tokens_per_s=measured,
        remaining_tokens=_remaining_tokens(profile, segment, gbs, base_gbs),
    )


def answer_probe(
    decision: Decision,
    measurement: Measurement,
    settings: PolicySettings,
    probes: tuple[ProbeOutcome, ...],
    candidates: tuple[Candidate, ...],
    segment_times_s: np.ndarray,
    pair: tuple[int, int],
) -> tuple[Decision, float, list[dict]]:
    """The decision on the replay's answer to a probe the policy asked for: the run's recorded outcome
    where one fits, else the world's (:mod:`cona.planner.probe_replay`; ``pair``: the indices of the current
    and the candidate in ``candidates``, at their true rates; ``segment_times_s``: every candidate's seconds
    for the segment); the seconds the losing branch took (the caller's clock adds them); the records to keep
    (the probe's, and a lost probe's stay, which holds what it cost)."""
    current, other = pair
    outcome = replayed_outcome(
        probes, consumed_tokens=measurement.consumed_tokens, probe_tokens=settings.probe_tokens,
        current=candidates[current], candidate=candidates[other],
        segment_s=(float(segment_times_s[current]), float(segment_times_s[other])),
    )  # fmt: skip
    assert decision.target is not None
    answered = decide(decision.state, replace(measurement, probe=outcome), decision.target, settings)
    records = [decision.record] + ([] if answered.target is not None else [answered.record])
    return answered, lost_s(outcome), records


def _remaining_tokens(profile: NoiseProfile, segment: int, gbs: int, base_gbs: int) -> float:
    """Tokens from ``segment``'s start to the target at ``gbs`` and the noise scale known there."""
    noise = profile.noise_scale[segment]
    return float((profile.edges[-1] - profile.edges[segment]) * (noise + gbs) / (noise + base_gbs))


def stages_of(
    assignment: np.ndarray,
    profile: NoiseProfile,
    candidates: tuple[Candidate, ...],
    *,
    base_gbs: int,
    seq: int,
) -> tuple[Stage, ...]:
    """The chain's stages: runs of one candidate, with their tokens, iterations (at least 1) and seconds."""
    times = segment_times(profile, candidates, base_gbs)
    tokens = raw_tokens(profile, candidates, base_gbs)
    stages = []
    boundaries = np.flatnonzero(np.diff(assignment)) + 1
    for run in np.split(np.arange(len(assignment)), boundaries):
        index = int(assignment[run[0]])
        strategy = candidates[index].strategy
        stage_tokens = float(tokens[run, index].sum())
        iterations = max(1, round(stage_tokens / (strategy.gbs * seq)))
        time_s = float(times[run, index].sum())
        stages.append(Stage(strategy=strategy, iterations=iterations, tokens=stage_tokens, time_s=time_s))
    return tuple(stages)


def chain_config(stages: tuple[Stage, ...]) -> dict:
    """A chain file (:mod:`cona.runner.chain_file`) that trains ``stages`` in order."""
    steps = []
    for number, stage in enumerate(stages, start=1):
        s = stage.strategy
        step: dict = {"step_num": number, "dp": s.dp, "tp": s.tp, "pp": s.pp, "gbs": s.gbs, "mbs": s.mbs}
        if number == 1:
            step.update(train_iters=stage.iterations, is_initial=True)
        else:
            previous = stages[number - 2].strategy
            step.update(
                extra_iters=stage.iterations, load_dp=previous.dp, load_tp=previous.tp, load_pp=previous.pp
            )
        step["convert"] = number < len(stages)
        steps.append(step)
    return {"steps": steps}


def target_progress(
    trace: Trace,
    base_gbs: int,
    *,
    target_loss: float | None = None,
    total_tokens: float | None = None,
    noise_scale_factor: float = 1.0,
) -> float:
    """The progress to reach: where the trace's loss first reached ``target_loss``, or the trace's progress
    after ``total_tokens`` tokens, or at its end when neither is given."""
    if target_loss is not None:
        tokens = trace.tokens_at_loss(target_loss)
    else:
        tokens = total_tokens if total_tokens is not None else float(trace.tokens[-1])
    return progress_at_tokens(trace, base_gbs, tokens, noise_scale_factor=noise_scale_factor)


def plan(
    config: ConaConfig,
    trace: Trace,
    *,
    search: SearchSettings,
    policy: PolicySettings,
    initial_gbs: int,
    progress: float,
    switch_cost_s: float,
    segments: int = DEFAULT_SEGMENTS,
) -> PlanResult:
    """Static, optimal and online chains over the frontier's best strategies, to ``progress``."""
    if switch_cost_s < 0:
        raise PlanError(f"--switch-cost-s must be non-negative, got {switch_cost_s}")
    candidates = best_candidates(config, frontier_sizes(initial_gbs, policy), search)
    return simulate(
        candidates,
        noise_profile(
            trace, policy.base_gbs, progress, segments, noise_scale_factor=policy.noise_scale_factor
        ),
        policy=policy,
        switch_cost_s=switch_cost_s,
        seq=config.model.seq,
        probes=trace.probes,
    )


def simulate(
    candidates: tuple[Candidate, ...],
    profile: NoiseProfile,
    *,
    policy: PolicySettings,
    switch_cost_s: float,
    seq: int,
    believed: tuple[Candidate, ...] | None = None,
    probes: tuple[ProbeOutcome, ...] = (),
) -> PlanResult:
    """The comparison on given candidates (increasing gbs) and noise profile; ``believed`` and ``probes`` as
    in :func:`online_assignment` (the online chain's time includes its probes' losing branches)."""
    base = policy.base_gbs
    times = segment_times(profile, candidates, base)

    def chain(name: str, assignment: np.ndarray, extra_s: float = 0.0) -> ChainPlan:
        return ChainPlan(
            name=name,
            assignment=assignment,
            time_s=chain_time(times, assignment, switch_cost_s) + extra_s,
            stages=stages_of(assignment, profile, candidates, base_gbs=base, seq=seq),
        )

    static = tuple(
        chain(f"static gbs {c.strategy.gbs}", np.full(len(profile.estimates), index))
        for index, c in enumerate(candidates)
    )
    settings = replace(policy, predicted_switch_cost_s=switch_cost_s)
    online, decisions = online_assignment(
        profile, candidates, settings, switch_cost_s=switch_cost_s, seq=seq, believed=believed, probes=probes
    )
    return PlanResult(
        candidates=candidates,
        static=static,
        optimum=chain("hindsight optimum", optimal_assignment(times, switch_cost_s)),
        online=chain("CONA online", online, probes_lost_s(decisions)),
        decisions=decisions,
        target_progress=float(profile.edges[-1]),
        switch_cost_s=switch_cost_s,
    )
