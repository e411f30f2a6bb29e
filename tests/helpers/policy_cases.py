"""Shared cases of the policy tests: a tracker fed exact measurements of a chosen noise scale, a measurement
built on it, and the strategies the tests switch between."""

from cona.planner.efficiency import NoiseScaleTracker
from cona.planner.policy import Candidate, Measurement, PolicySettings, initial_state
from cona.planner.probe_rule import BranchRun, ProbeOutcome, judge
from cona.strategy import Strategy

BASE = 16
SMALL = Strategy(dp=4, tp=1, pp=1, mbs=4, gbs=16)
LARGE = Strategy(dp=2, tp=2, pp=1, mbs=8, gbs=32)
SETTINGS = PolicySettings(base_gbs=BASE, max_gbs=64, predicted_switch_cost_s=10.0)


def tracker_at(noise_scale: float, count: int = 20, grad_sqr: float = 1.0) -> NoiseScaleTracker:
    """A tracker fed ``count`` exact two-batch measurements of ``|G|^2`` and ``tr(Sigma) = phi |G|^2``."""
    tracker = NoiseScaleTracker(base_batch=BASE)
    trace_sigma = noise_scale * abs(grad_sqr)
    for _ in range(count):
        tracker = tracker.update(
            small_sqr=grad_sqr + trace_sigma / 4,
            big_sqr=grad_sqr + trace_sigma / 16,
            small_batch=4,
            big_batch=16,
        )
    return tracker


def measure(noise_scale: float, *, tokens_per_s: float = 1000.0, remaining: float = 1e7, count: int = 20):
    return Measurement(
        time=0.0,
        iteration=100,
        consumed_tokens=10_000,
        noise=tracker_at(noise_scale, count).estimate(),
        measured_tokens_per_s=tokens_per_s,
        remaining_tokens=remaining,
    )


def fresh_state():
    return initial_state(Candidate(strategy=SMALL, predicted_tokens_per_s=1000.0))


CANDIDATE = Candidate(strategy=LARGE, predicted_tokens_per_s=1800.0)


def branch(gbs: int, loss: float, seconds: float) -> BranchRun:
    return BranchRun(
        gbs=gbs, mbs=gbs // 4, lr=1e-3, steps=4096 // gbs, loss=loss, train_loss=loss + 0.1,
        seconds=seconds, steady_seconds=seconds,
    )  # fmt: skip


def outcome(candidate_loss: float, candidate_s: float = 2.0) -> ProbeOutcome:
    current, candidate = branch(16, 4.0, 4.0), branch(32, candidate_loss, candidate_s)
    winner, reason = judge(start_loss=4.2, current=current, candidate=candidate, tolerance=0.01)
    return ProbeOutcome(
        stage=1, iteration=100, consumed_samples=1600, samples=4096, tokens=4096 * 8, start_loss=4.2,
        current=current, candidate=candidate, tolerance=0.01, winner=winner, reason=reason, wall_s=6.5,
    )  # fmt: skip
