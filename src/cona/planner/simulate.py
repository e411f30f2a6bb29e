"""The offline plan simulated against a ground truth apart from what the policy believes.

:func:`cona.planner.plan.simulate` times every chain with the throughputs and the noise scale the policy is
given, so it can only show the policy consistent with itself. Here the world and the policy differ:

* **Throughput truth with a host-bound floor.** A strategy's true step time is ``max(host_floor_s +
  micro_batches x per_micro_batch_s, model step time)`` (the shape of a measured GPU step: a small per-GPU
  step is bound by Python and kernel launches, whose time grows with the micro-batches per step, not with
  their size), where the model step time is the performance model's prediction. The policy is told the model's
  throughput for the frontier (as before any measurement of it) and measures the strategy it runs at its true
  throughput.
* **Measurement noise.** The running strategy's measured throughput and the noise scale the policy reads are
  the true ones times seeded log-normal noise, independently per segment (the truth itself is noise free).

The static chains, the hindsight optimum and CONA's chain are all timed on the truth.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from cona.planner.chains import NoiseProfile, chain_time, optimal_assignment, segment_times
from cona.planner.plan import ChainPlan, PlanResult, online_assignment, stages_of
from cona.planner.policy import Candidate, PolicySettings
from cona.planner.probe_replay import probes_lost_s


@dataclass(frozen=True, kw_only=True)
class HostBound:
    """The host-bound floor of the truth, in fractions of the first candidate's modelled step time ``T0``
    (so one setting scales to every model): floor ``floor_fraction x T0`` per step plus
    ``micro_batch_fraction x T0 / m0`` per micro-batch (``m0``: the first candidate's micro-batches)."""

    floor_fraction: float = 0.2
    micro_batch_fraction: float = 0.9


@dataclass(frozen=True, kw_only=True)
class MeasurementNoise:
    """Log-normal sigmas of what the policy reads (0: exact), and the seed of their random draws."""

    noise_scale_sigma: float = 0.3
    throughput_sigma: float = 0.03
    seed: int = 0


def micro_batches(candidate: Candidate) -> int:
    strategy = candidate.strategy
    return max(1, strategy.gbs // (strategy.mbs * strategy.dp))


def true_candidates(candidates: tuple[Candidate, ...], host: HostBound, seq: int) -> tuple[Candidate, ...]:
    """The candidates at their true throughput: the model's step time or the host floor, the longer."""
    first = candidates[0]
    first_step_s = first.strategy.gbs * seq / first.predicted_tokens_per_s
    floor_s = host.floor_fraction * first_step_s
    per_micro_batch_s = host.micro_batch_fraction * first_step_s / micro_batches(first)
    truth = []
    for candidate in candidates:
        tokens = candidate.strategy.gbs * seq
        model_s = tokens / candidate.predicted_tokens_per_s
        step_s = max(floor_s + micro_batches(candidate) * per_micro_batch_s, model_s)
        truth.append(replace(candidate, predicted_tokens_per_s=tokens / step_s))
    return tuple(truth)


def noisy_profile(profile: NoiseProfile, sigma: float, rng: np.random.Generator) -> NoiseProfile:
    """The profile as a noisy tracker reports it: each known noise scale times log-normal noise."""
    factors = np.exp(rng.normal(0.0, sigma, size=len(profile.estimates)))
    estimates = tuple(
        None if estimate is None else replace(estimate, trace_sigma=estimate.trace_sigma * float(factor))
        for estimate, factor in zip(profile.estimates, factors, strict=True)
    )
    return replace(profile, estimates=estimates)


def simulate_against_truth(
    candidates: tuple[Candidate, ...],
    profile: NoiseProfile,
    *,
    policy: PolicySettings,
    switch_cost_s: float,
    seq: int,
    host: HostBound,
    noise: MeasurementNoise,
) -> PlanResult:
    """Static, optimal and CONA's chains timed on the truth; ``candidates`` hold the model's throughputs
    (what the policy believes), ``profile`` the true noise scale."""
    rng = np.random.default_rng(noise.seed)
    truth = true_candidates(candidates, host, seq)
    seen = noisy_profile(profile, noise.noise_scale_sigma, rng)
    measured_noise = np.exp(
        rng.normal(0.0, noise.throughput_sigma, size=(len(profile.estimates), len(truth)))
    )

    def measure(segment: int, index: int) -> float:
        return truth[index].predicted_tokens_per_s * float(measured_noise[segment, index])

    settings = replace(policy, predicted_switch_cost_s=switch_cost_s)
    online, decisions = online_assignment(
        seen, truth, settings, switch_cost_s=switch_cost_s, seq=seq, believed=candidates, measure=measure
    )
    times = segment_times(profile, truth, policy.base_gbs)

    def chain(name: str, assignment: np.ndarray, extra_s: float = 0.0) -> ChainPlan:
        stages = stages_of(assignment, profile, truth, base_gbs=policy.base_gbs, seq=seq)
        return ChainPlan(
            name=name,
            assignment=assignment,
            time_s=chain_time(times, assignment, switch_cost_s) + extra_s,
            stages=stages,
        )

    segments = len(profile.estimates)
    return PlanResult(
        candidates=truth,
        static=tuple(
            chain(f"static gbs {c.strategy.gbs}", np.full(segments, i)) for i, c in enumerate(truth)
        ),
        optimum=chain("hindsight optimum", optimal_assignment(times, switch_cost_s)),
        online=chain("CONA online", online, probes_lost_s(decisions)),  # its probes' losing branches
        decisions=decisions,
        target_progress=float(profile.edges[-1]),
        switch_cost_s=switch_cost_s,
    )
