"""Time to a target loss on a cluster, simulated from measured statistical curves and the performance model.

The world (:class:`World`): the candidates are the performance model's best strategy at each gbs of the
curves on the cluster (what a static planner such as AMP, Alpa, Metis, Galvatron or vTrain picks for a
gbs); the tokens each gbs needs between two losses of a ladder come from its measured curve
(:mod:`cona.planner.curves`); a segment's seconds are those tokens over the strategy's throughput; a change
of strategy costs what :func:`cona.planner.switch_cost.predicted_switch_cost_s` predicts.

Compared on that world (:func:`compare`):

* **static at the user's gbs**: the static planner's strategy at the initial gbs, for the whole run;
* **tuned best fixed**: the fastest single strategy of all gbs (a fixed gbs tuned in hindsight);
* **token ramp**: the gbs doubled through the candidates at equal token milestones over the first
  ``ramp_share`` of the tokens the user's gbs needs (GPT-3's kind of batch ramp), each at its best layout;
* **CONA online**: the policy's own code (:func:`cona.planner.policy.decide` with
  :func:`~cona.planner.policy.next_frontier` over the model's candidates, a trained one at its measured
  rate) at the loss levels where a run would have logged, on what it would have measured there: the
  running strategy's true throughput with measurement noise, and the noise scale its curve's tracker
  reported;
* **hindsight optimum**: dynamic programming over (loss level, candidate), every switch's cost charged.

The model's error is carried into the answer (:func:`compare_with_error`): each comparison is repeated with
every candidate's true throughput the model's times ``1 + e``, ``e`` drawn from a normal of the published
mean |error| (clipped at the largest published error), while the policy and the static planner still see
the model's numbers; the spread of every ratio over the draws is reported with its nominal value.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from cona.errors import PlanError
from cona.planner.chains import chain_time, optimal_assignment
from cona.planner.curves import StatCurves
from cona.planner.efficiency import NoiseScaleEstimate
from cona.planner.plan import ChainPlan, Stage, answer_probe
from cona.planner.policy import (
    Candidate,
    Measurement,
    PolicySettings,
    after_switch,
    decide,
    initial_state,
    next_frontier,
)
from cona.planner.probe_replay import probes_lost_s

RAMP_SHARE = 0.5
"""The token ramp reaches its largest gbs after this share of the tokens the user's gbs needs."""
MEASUREMENT_SIGMA = 0.02
"""Log-normal sigma of a measured throughput around the true one (step-time jitter over a log interval)."""


@dataclass(frozen=True, kw_only=True)
class World:
    """One cluster and one model to one target: candidates in increasing gbs, segments in falling loss."""

    candidates: tuple[Candidate, ...]
    """The model's best strategy of each gbs, with the model's throughput (what planners believe)."""
    segment_tokens: np.ndarray
    """``[segments, candidates]``: tokens from the previous loss level to this one (the first from 0)."""
    noise: tuple[tuple[NoiseScaleEstimate | None, ...], ...]
    """``[segments][candidates]``: what the candidate's run had measured when it reached the level before."""
    switch_costs_s: np.ndarray
    """``[from, to]`` seconds."""
    initial: int
    """Index of the user's gbs."""
    seq: int
    left_out: tuple[str, ...] = ()
    """Why a gbs of the curves has no candidate here (no strategy fits; its run stopped above the target)."""

    @property
    def believed_tokens_per_s(self) -> np.ndarray:
        return np.asarray([c.predicted_tokens_per_s for c in self.candidates])


def build_world(
    curves: StatCurves,
    candidates: tuple[Candidate, ...],
    *,
    target_loss: float,
    segments: int,
    initial_gbs: int,
    switch_cost: Callable[[Candidate, Candidate], float],
) -> World:
    """The world of ``candidates``: those whose gbs's curve reaches the target (the others are left out)."""
    levels = curves.ladder(target_loss, segments)
    kept, columns, noise_columns, left_out = [], [], [], []
    for candidate in candidates:
        curve = curves.curve(candidate.strategy.gbs)
        reached = curve.tokens_to_losses(levels)
        if not np.isfinite(reached[-1]):
            lowest = float(np.min(curve.eval_loss))
            left_out.append(f"gbs {curve.gbs}: its run stopped at eval loss {lowest:.4g}, above the target")
            continue
        kept.append(candidate)
        columns.append(np.diff(reached, prepend=0.0))
        starts = np.concatenate([[0.0], reached[:-1]])
        noise_columns.append([curve.noise_at(tokens) for tokens in starts])
    gbs = [c.strategy.gbs for c in kept]
    if initial_gbs not in gbs:
        raise PlanError(
            f"--initial-gbs: gbs {initial_gbs} has no strategy that fits or no curve that reaches the target "
            f"(these do: {', '.join(map(str, gbs))})"
        )
    costs = np.asarray([[switch_cost(a, b) for b in kept] for a in kept], dtype=np.float64)
    return World(
        candidates=tuple(kept),
        segment_tokens=np.stack(columns, axis=1),
        noise=tuple(zip(*noise_columns, strict=True)),
        switch_costs_s=costs,
        initial=gbs.index(initial_gbs),
        seq=curves.model.seq,
        left_out=tuple(left_out),
    )


@dataclass(frozen=True, kw_only=True)
class Comparison:
    """Every plan's chain on one world at one set of true throughputs."""

    static_user: ChainPlan
    tuned_fixed: ChainPlan
    ramp: ChainPlan
    online: ChainPlan
    optimum: ChainPlan
    decisions: tuple[dict, ...]

    @property
    def baselines(self) -> tuple[ChainPlan, ...]:
        return (self.static_user, self.tuned_fixed, self.ramp)


def ramp_assignment(world: World, share: float = RAMP_SHARE) -> np.ndarray:
    """The token ramp: from the user's gbs through every larger candidate, moving on at equal token
    milestones over ``share`` of the tokens the user's gbs needs to the target."""
    steps = len(world.candidates) - world.initial
    total = float(world.segment_tokens[:, world.initial].sum())
    milestones = [share * total * (s + 1) / max(steps - 1, 1) for s in range(steps - 1)]
    assignment = np.empty(len(world.segment_tokens), dtype=np.int64)
    consumed, stage = 0.0, 0
    for k in range(len(assignment)):
        while stage < len(milestones) and consumed >= milestones[stage]:
            stage += 1
        assignment[k] = world.initial + stage
        consumed += world.segment_tokens[k, assignment[k]]
    return assignment


def online_assignment(
    world: World, settings: PolicySettings, true_tokens_per_s: np.ndarray, rng: np.random.Generator
) -> tuple[np.ndarray, tuple[dict, ...]]:
    """CONA's chain from the user's gbs: the policy decides at a loss level once ``decision_interval``
    iterations have run since its last decision (as a run decides at its metrics lines), on what the run
    measured there."""
    by_gbs = {c.strategy.gbs: c for c in world.candidates}  # the model's, until a strategy is measured
    index_of = {c.strategy: i for i, c in enumerate(world.candidates)}
    current, state = world.initial, initial_state(world.candidates[world.initial])
    clock = consumed = iteration = decided_at = 0.0
    assignment = np.empty(len(world.segment_tokens), dtype=np.int64)
    decisions = []
    for k in range(len(assignment)):
        if k > 0 and iteration - decided_at >= settings.decision_interval:
            decided_at = iteration
            measured = float(true_tokens_per_s[current] * math.exp(rng.normal(0.0, MEASUREMENT_SIGMA)))
            gbs = world.candidates[current].strategy.gbs
            # online mode's search offers a strategy the run has trained at its measured rate
            by_gbs[gbs] = Candidate(
                strategy=world.candidates[current].strategy, predicted_tokens_per_s=measured,
                throughput_source="measured",
            )  # fmt: skip
            frontier = next_frontier(gbs, measured, settings, by_gbs.get)
            cost = world.switch_costs_s[current, index_of[frontier.strategy]] if frontier else 0.0
            measurement = Measurement(
                time=clock, iteration=int(iteration), consumed_tokens=int(consumed),
                noise=world.noise[k][current], measured_tokens_per_s=measured,
                remaining_tokens=float(world.segment_tokens[k:, current].sum()),
                interval_tokens=float(world.segment_tokens[k, current]),
            )  # fmt: skip
            decision = decide(state, measurement, frontier, _with_cost(settings, cost))
            if decision.action == "probe" and frontier is not None:  # the world answers: no run recorded one
                seconds = world.segment_tokens[k] / true_tokens_per_s
                truth = tuple(
                    dataclasses.replace(c, predicted_tokens_per_s=float(rate))
                    for c, rate in zip(world.candidates, true_tokens_per_s, strict=True)
                )
                pair = (current, index_of[frontier.strategy])
                decision, spent_s, records = answer_probe(
                    decision, measurement, _with_cost(settings, cost), (), truth, seconds, pair
                )
                clock += spent_s
                decisions += records
            state = decision.state
            if decision.target is not None:
                decisions.append(decision.record)
                target = index_of[decision.target.strategy]
                charged = float(world.switch_costs_s[current, target])
                state = after_switch(
                    state, new=decision.target, old_measured_tokens_per_s=measured, switch_cost_s=charged,
                    in_place=world.candidates[current].strategy.same_layout(decision.target.strategy),
                )  # fmt: skip
                clock, current = clock + charged, target
        assignment[k] = current
        tokens = world.segment_tokens[k, current]
        clock += tokens / true_tokens_per_s[current]
        consumed += tokens
        iteration += tokens / (world.candidates[current].strategy.gbs * world.seq)
    return assignment, tuple(decisions)


def _with_cost(settings: PolicySettings, cost_s: float) -> PolicySettings:
    """The policy told the predicted cost of the switch it weighs (in place or through a checkpoint)."""
    return dataclasses.replace(settings, predicted_switch_cost_s=cost_s)


def compare(
    world: World, settings: PolicySettings, true_tokens_per_s: np.ndarray, *, seed: int = 0
) -> Comparison:
    """Every plan timed on ``true_tokens_per_s``; the static planner and the policy see the model's."""
    times = world.segment_tokens / true_tokens_per_s[None, :]
    count = len(world.segment_tokens)

    def chain(name: str, assignment: np.ndarray, extra_s: float = 0.0) -> ChainPlan:
        return ChainPlan(
            name=name,
            assignment=assignment,
            time_s=chain_time(times, assignment, world.switch_costs_s) + extra_s,
            stages=_stages(world, times, assignment),
        )

    fixed = [chain(f"fixed {c.strategy.short()}", np.full(count, j)) for j, c in enumerate(world.candidates)]
    online, decisions = online_assignment(world, settings, true_tokens_per_s, np.random.default_rng(seed))
    return Comparison(
        static_user=dataclasses.replace(fixed[world.initial], name="static planner at the user's gbs"),
        tuned_fixed=dataclasses.replace(min(fixed, key=lambda plan: plan.time_s), name="tuned best fixed"),
        ramp=chain("token ramp", ramp_assignment(world)),
        online=chain("CONA online", online, probes_lost_s(decisions)),  # with its probes' losing branches
        optimum=chain("hindsight optimum", optimal_assignment(times, world.switch_costs_s)),
        decisions=decisions,
    )


def _stages(world: World, times: np.ndarray, assignment: np.ndarray) -> tuple[Stage, ...]:
    stages = []
    for run in np.split(np.arange(len(assignment)), np.flatnonzero(np.diff(assignment)) + 1):
        index = int(assignment[run[0]])
        strategy = world.candidates[index].strategy
        tokens = float(world.segment_tokens[run, index].sum())
        stages.append(
            Stage(
                strategy=strategy,
                iterations=max(1, round(tokens / (strategy.gbs * world.seq))),
                tokens=tokens,
                time_s=float(times[run, index].sum()),
            )
        )
    return tuple(stages)


@dataclass(frozen=True, kw_only=True)
class ModelError:
    """The performance model's measured error on published points: mean and largest ``|predicted / measured
    - 1|``, and how many perturbed worlds to draw."""

    mean: float
    largest: float
    draws: int = 32
    seed: int = 0

    def factors(self, count: int, rng: np.random.Generator) -> np.ndarray:
        """True / predicted throughput of ``count`` candidates: a normal of mean |e| = ``mean``, clipped."""
        sigma = self.mean * math.sqrt(math.pi / 2.0)
        return 1.0 + np.clip(rng.normal(0.0, sigma, size=count), -self.largest, self.largest)


@dataclass(frozen=True, kw_only=True)
class ErrorSpread:
    """The nominal comparison (truth = model) and every perturbed one."""

    nominal: Comparison
    perturbed: tuple[Comparison, ...]

    def speedups(self, pick: Callable[[Comparison], ChainPlan]) -> tuple[float, float, float]:
        """A baseline's time over CONA's: nominal, lowest and highest over the perturbed worlds."""
        values = [pick(c).time_s / c.online.time_s for c in self.perturbed]
        return pick(self.nominal).time_s / self.nominal.online.time_s, min(values), max(values)

    def to_optimum(self) -> tuple[float, float, float]:
        """CONA's time over the optimum's, minus 1: nominal, lowest and highest."""
        values = [c.online.time_s / c.optimum.time_s - 1.0 for c in self.perturbed]
        return self.nominal.online.time_s / self.nominal.optimum.time_s - 1.0, min(values), max(values)


def compare_with_error(world: World, settings: PolicySettings, error: ModelError) -> ErrorSpread:
    """:func:`compare` with the truth the model (nominal) and with ``error.draws`` perturbed truths."""
    rng = np.random.default_rng(error.seed)
    believed = world.believed_tokens_per_s
    perturbed = tuple(
        compare(world, settings, believed * error.factors(len(believed), rng), seed=draw + 1)
        for draw in range(error.draws)
    )
    return ErrorSpread(nominal=compare(world, settings, believed), perturbed=perturbed)
