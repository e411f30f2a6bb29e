"""What a probe finds in an offline replay (:func:`cona.planner.plan.online_assignment`), pure.

A replay on a trace decides with the same policy as a run, so where the policy asks for a probe the replay
needs its outcome. A probe the run recorded (``probes.jsonl`` beside the trace's metrics) between the same
two batches within :data:`cona.planner.policy_probe.PROBE_SPACING` of the tokens where the replay probes is
taken as it was measured: the nearest in tokens. Elsewhere the replay's world answers: the branch whose
progress per second is larger there (the world's throughput and noise scale, i.e. its segment times) wins,
at the world's rates.
"""

from __future__ import annotations

import math
from typing import Any

from cona.planner.policy_probe import PROBE_SPACING
from cona.planner.policy_types import Candidate
from cona.planner.probe_rule import BranchRun, ProbeOutcome
from cona.strategy import Strategy


def recorded_outcome(
    recorded: tuple[ProbeOutcome, ...], *, consumed_tokens: float, current_gbs: int, candidate_gbs: int
) -> ProbeOutcome | None:
    """The run's own probe of the same two batches nearest to ``consumed_tokens`` (in log tokens), within
    the probe spacing; None where there is none."""

    def distance(outcome: ProbeOutcome) -> float:
        start = outcome.consumed_samples * outcome.tokens / outcome.samples if outcome.samples else 0.0
        return abs(math.log(max(start, 1.0) / max(consumed_tokens, 1.0)))

    pair = (current_gbs, candidate_gbs)
    near = [
        o
        for o in recorded
        if (o.current.gbs, o.candidate.gbs) == pair and distance(o) <= math.log(PROBE_SPACING)
    ]
    return min(near, key=distance, default=None)


def modelled_outcome(
    *,
    probe_tokens: int,
    current: Strategy,
    candidate: Strategy,
    rates: tuple[float, float],
    segment_s: tuple[float, float],
) -> ProbeOutcome:
    """The world's answer: ``rates`` are the two strategies' tokens/s, ``segment_s`` their seconds for the
    same progress here (the smaller wins); the losses are unknown (NaN)."""
    winner = "candidate" if segment_s[1] < segment_s[0] else "current"
    reason = (
        f"modelled: the same progress takes {segment_s[1]:.3g} s at gbs {candidate.gbs} vs "
        f"{segment_s[0]:.3g} s at gbs {current.gbs}"
    )

    def branch(strategy: Strategy, rate: float) -> BranchRun:
        seconds = probe_tokens / rate
        steps = max(1, probe_tokens // max(strategy.gbs, 1))
        return BranchRun(
            gbs=strategy.gbs, mbs=strategy.mbs, lr=math.nan, steps=steps, loss=math.nan,
            train_loss=math.nan, seconds=seconds, steady_seconds=seconds,
        )  # fmt: skip

    return ProbeOutcome(
        stage=0,
        iteration=0,
        consumed_samples=0,
        samples=0,
        tokens=probe_tokens,
        start_loss=math.nan,
        current=branch(current, rates[0]),
        candidate=branch(candidate, rates[1]),
        tolerance=math.nan,
        winner=winner,
        reason=reason,
        wall_s=probe_tokens / rates[0] + probe_tokens / rates[1],
    )


def probes_lost_s(decisions: tuple[dict[str, Any], ...]) -> float:
    """Seconds the replay's probes spent on their losing branches (decision records with a ``probe``)."""
    return sum(
        record["probe"][
            "current_steady_s" if record["probe"]["winner"] == "candidate" else "candidate_steady_s"
        ]
        for record in decisions
        if isinstance(record.get("probe"), dict)
    )


def replayed_outcome(
    recorded: tuple[ProbeOutcome, ...],
    *,
    consumed_tokens: float,
    probe_tokens: int,
    current: Candidate,
    candidate: Candidate,
    segment_s: tuple[float, float],
) -> ProbeOutcome:
    """The recorded outcome that fits (:func:`recorded_outcome`), else the world's (:func:`modelled_outcome`,
    ``current`` and ``candidate`` at their true rates)."""
    found = recorded_outcome(
        recorded,
        consumed_tokens=consumed_tokens,
        current_gbs=current.strategy.gbs,
        candidate_gbs=candidate.strategy.gbs,
    )
    if found is not None:
        return found
    return modelled_outcome(
        probe_tokens=probe_tokens,
        current=current.strategy,
        candidate=candidate.strategy,
        rates=(current.predicted_tokens_per_s, candidate.predicted_tokens_per_s),
        segment_s=segment_s,
    )


def lost_s(outcome: ProbeOutcome) -> float:
    """The losing branch's wall seconds: what the probe cost the run beyond the winner's training."""
    return (outcome.current if outcome.winner == "candidate" else outcome.candidate).seconds
