"""The switching policy's data: its settings, candidates, state, measurements and decisions (frozen).

:mod:`cona.planner.policy` holds the rules over them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from cona.config import TrainingConfig
from cona.errors import PlanError
from cona.planner.efficiency import MIN_SAMPLES, NoiseScaleEstimate
from cona.planner.probe_rule import ProbeOutcome
from cona.strategy import Strategy

DEFAULT_HYSTERESIS = 0.05
"""Relative margin a switch must clear (AdaptDL uses 5 % on goodput)."""

Action = Literal["stay", "probe", "switch", "fallback"]
"""``probe``: run a paired probe of the target (:mod:`cona.planner.policy_probe`); ``switch``: move to the
target; ``fallback``: back to the previous stage's strategy (``training.fallback`` on); ``stay``: neither."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PolicySettings:
    """What the policy is allowed to do. Its eight settings, each with its unit: ``hysteresis`` (a fraction),
    ``fallback``, ``fallback_ema_alpha`` (a weight), ``fallback_patience`` (evaluations),
    ``noise_scale_factor`` (a multiple), ``probe``, ``probe_tokens`` (tokens) and ``probe_tolerance`` (nats);
    :meth:`from_training` reads them from the config. The other fields describe the run: its batch bounds
    and frontier, the switch costs to assume, whether switches happen in place, how often it decides."""

    base_gbs: int
    """``M0``: the batch the efficiency is relative to (``training.base_gbs``)."""
    max_gbs: int
    """The frontier never goes past this."""
    gbs_factor: int = 2
    """Next frontier = current gbs x this (capped at ``max_gbs``) unless ``gbs_list`` is given."""
    gbs_list: tuple[int, ...] | None = None
    """Explicit frontier: the next gbs is the smallest listed one above the current."""
    hysteresis: float = DEFAULT_HYSTERESIS
    """Fraction by which what a switch or probe saves must exceed what it costs."""
    min_measurements: int = MIN_SAMPLES
    """Noise-scale measurements needed before any switch."""
    predicted_switch_cost_s: float = 0.0
    """Switch cost assumed until a switch has been measured."""
    in_place: bool = False
    """Whether the runner can switch in place (same processes, state kept in memory) to a strategy that
    keeps the layout; such a switch is charged its own cost."""
    in_place_mbs: bool = True
    """With ``in_place``: whether such a switch may also change mbs (the native engine's may; the
    Megatron-DeepSpeed backend's changes the gbs only, so an mbs change goes through a checkpoint)."""
    predicted_in_place_cost_s: float = 1.0
    """In-place switch cost assumed until one has been measured (a rebuild of the batch-dependent parts and,
    compiled, a first step at a new shape)."""
    fallback: bool = False
    """Move back to the previous (smaller) gbs when the smoothed noise scale stays below the break-even of
    the two (``training.fallback``)."""
    fallback_ema_alpha: float = 0.1
    """Weight, in (0, 1], of a new noise-scale reading in the fallback's EMA
    (``training.fallback_ema_alpha``): 0.1 averages about ten evaluations, so one noisy reading does not move
    the run back."""
    fallback_patience: int = 3
    """Consecutive evaluations below the break-even before a fallback (``training.fallback_patience``)."""
    noise_scale_factor: float = 1.0
    """The efficiency's ``phi``: the measured noise scale times this (``training.noise_scale_factor``)."""
    decision_interval: int = 1
    """Iterations between two decisions: a run decides at its metrics lines (``training.log_interval``),
    so an offline simulation (:func:`cona.planner.plan.online_assignment`) may not decide more often."""
    probe: bool = False
    """Decide a switch that keeps the layout (with ``in_place``) by a paired probe (``training.probe``)."""
    probe_tokens: int = 131072
    """Tokens each branch of a probe trains (``training.probe_tokens``)."""
    probe_tolerance: float = 0.01
    """Probe-loss difference (nats) within which branches count as equal (``training.probe_tolerance``)."""

    def __post_init__(self) -> None:
        if self.base_gbs < 1 or self.max_gbs < 1:
            raise PlanError(f"gbs bounds must be positive, got base {self.base_gbs}, max {self.max_gbs}")
        if self.gbs_factor < 2:
            raise PlanError(f"the frontier's gbs factor must be at least 2, got {self.gbs_factor}")
        if self.gbs_list is not None and (not self.gbs_list or min(self.gbs_list) < 1):
            raise PlanError(f"the frontier's gbs list must hold positive sizes, got {self.gbs_list}")
        if self.hysteresis < 0 or min(self.predicted_switch_cost_s, self.predicted_in_place_cost_s) < 0:
            raise PlanError("hysteresis and switch cost must be non-negative")
        if not self.noise_scale_factor > 0:
            raise PlanError(f"noise_scale_factor must be positive, got {self.noise_scale_factor}")
        if self.decision_interval < 1:
            raise PlanError(f"decision_interval must be at least 1, got {self.decision_interval}")
        if self.probe_tokens < 1 or self.probe_tolerance < 0:
            raise PlanError("probe_tokens must be positive and probe_tolerance non-negative")
        if not 0.0 < self.fallback_ema_alpha <= 1.0 or self.fallback_patience < 1:
            raise PlanError("fallback_ema_alpha must be in (0, 1] and fallback_patience at least 1")

    @classmethod
    def from_training(cls, training: TrainingConfig, *, max_gbs: int, **overrides: Any) -> PolicySettings:
        values: dict[str, Any] = {
            "base_gbs": training.lr.base_gbs,
            "max_gbs": max_gbs,
            "fallback": training.online.fallback,
            "fallback_ema_alpha": training.online.fallback_ema_alpha,
            "fallback_patience": training.online.fallback_patience,
            "noise_scale_factor": training.online.noise_scale_factor,
            "decision_interval": training.logging.log_interval,
            "probe": training.online.probe,
            "probe_tokens": training.online.probe_tokens,
            "probe_tolerance": training.online.probe_tolerance,
        }
        values.update(overrides)
        return cls(**values)


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    """A strategy with the performance model's predicted throughput."""

    strategy: Strategy
    predicted_tokens_per_s: float
    throughput_source: str = "predicted"
    """``measured`` when the run already trained this strategy and the number is what it measured."""
    fitted_on: int = 0
    """Predicted: the measured strategies the throughput model's shape was fitted on (0: the raw model)."""
    on_first_line: bool = False
    """Predicted by the model fitted on the run's first line only (a proxy of the strategy's steps)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class FinishedStage:
    """An earlier stage, kept as the fallback target: its strategy and its measured throughput."""

    strategy: Strategy
    measured_tokens_per_s: float
    rate_measured: bool = True
    """False: the run left it before any steady line, and ``measured_tokens_per_s`` is the throughput
    estimator's (the search refits it as the run measures other strategies)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ProbedAt:
    """Where a candidate gbs last lost a probe: the run's tokens and the noise scale then (samples)."""

    gbs: int
    consumed_tokens: int
    noise_scale: float | None


@dataclass(frozen=True, kw_only=True, slots=True)
class PolicyState:
    """What the policy remembers between evaluations. Start with :func:`initial_state`."""

    current: Candidate
    """The running strategy and what the model predicted for it."""
    earlier: tuple[FinishedStage, ...] = ()
    """Stages at smaller gbs that led here, oldest first (a fallback pops the last one)."""
    measured_switch_cost_s: float | None = None
    """Mean of the measured switch costs so far (through a checkpoint)."""
    switches: int = 0
    measured_in_place_cost_s: float | None = None
    """Mean of the measured in-place switch costs so far."""
    in_place_switches: int = 0
    noise_ema: float | None = None
    """The fallback EMA of the noise scale (samples)."""
    below_break_even: int = 0
    """Consecutive evaluations with the EMA below the fallback break-even noise scale."""
    probing: Candidate | None = None
    """The candidate of the probe asked for and not yet answered."""
    probed: tuple[ProbedAt, ...] = ()
    """The latest lost probe of each candidate gbs (:data:`cona.planner.policy_probe.PROBE_SPACING`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Measurement:
    """What the runner knows at one evaluation (only the past)."""

    time: float
    """Unix time (or simulated seconds)."""
    iteration: int
    consumed_tokens: int
    noise: NoiseScaleEstimate | None
    """The tracker's estimate (None before it has ``min_samples``)."""
    noise_measurements: int = 0
    """Measurements the tracker holds, also before it gives an estimate (what a decision's reason counts)."""
    measured_tokens_per_s: float | None
    """The current strategy's measured throughput (None before a step was timed)."""
    rate_measured: bool = True
    """False: the run has measured no throughput yet and ``measured_tokens_per_s`` is the estimator's
    prediction of the current strategy; no switch is made on it (a probe measures both rates itself)."""
    remaining_tokens: float
    """Tokens still to train under the current strategy (the run's budget minus what is done)."""
    probe: ProbeOutcome | None = None
    """The outcome of the probe the last decision asked for, when it arrived since (None: none)."""
    interval_tokens: float = 0.0
    """Tokens between two evaluations (a metrics interval): a switch needs some left after it to happen at
    all, and to be measured (0: no such limit, as in a simulation that switches between evaluations)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Decision:
    """What to do, why, the numbers behind it (``record``: one line of decisions.jsonl), the next state."""

    action: Action
    target: Candidate | None
    """What to switch (or fall back) to, with the throughput expected of it; None when staying. A fallback's
    throughput is the one measured when that strategy last ran."""
    reason: str
    record: dict[str, Any]
    state: PolicyState
