"""The paired probe's rule: which of two branches trained on the same samples from the same state wins (pure).

A probe trains the next ``samples`` samples twice from one state: once at the current global batch (the
*current* branch), once at a candidate's batch and LR (the *candidate* branch), and evaluates both on one
fixed probe set. Both branches see the same samples in the same order from the same weights, so the loss
difference is the batch's (and its LR's) own effect, not the data's; the engine runs it
(:mod:`cona.engine.probe_branch`), this module judges it, and the policy (:mod:`cona.planner.policy`) and the
offline replay (:mod:`cona.planner.simulate`) read the same outcome.

The rule: the branch that lowers the probe loss more per second of training wins. Losses within
``tolerance`` of each other count as equal (the branches trained the same tokens to the same quality), and
then the faster branch wins; a candidate that is not faster never wins a tie, so a switch is only made for a
measured gain.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

from cona.errors import PlanError

Winner = Literal["current", "candidate"]


@dataclass(frozen=True, kw_only=True, slots=True)
class BranchRun:
    """One branch of a probe: its batch, its LR at the start, the probe loss after it, and its time."""

    gbs: int
    mbs: int
    lr: float
    """The LR of the branch's first step (its schedule, scaled by the candidate's LR rule)."""
    steps: int
    loss: float
    """Mean token loss of the probe set after the branch (nats)."""
    train_loss: float
    """Mean of the branch's training-step losses (nats): the same samples in both branches."""
    seconds: float
    """Wall seconds the branch's steps took, its start-up included (what the run spent on it)."""
    steady_seconds: float
    """Seconds its samples take at the branch's steady rate (steps that warmed up a new shape left out):
    what the same samples would cost from now on."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ProbeOutcome:
    """What a probe measured and which branch the run continues from (one line of ``probes.jsonl``)."""

    stage: int
    iteration: int
    """Iteration the probe started at (both branches start here)."""
    consumed_samples: int
    """Samples trained before the probe; each branch trains ``samples`` after them."""
    samples: int
    tokens: int
    """Tokens each branch trained (``samples`` sequences)."""
    start_loss: float
    """Probe-set loss before either branch (nats)."""
    current: BranchRun
    candidate: BranchRun
    tolerance: float
    winner: Winner
    reason: str
    wall_s: float
    """The whole probe: both branches, the three evaluations, the copies and restores (seconds)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ProbeOutcome:
        values = dict(raw)
        values["current"] = BranchRun(**raw["current"])
        values["candidate"] = BranchRun(**raw["candidate"])
        return cls(**values)

    @property
    def loss_difference(self) -> float:
        """Candidate minus current probe loss (nats): positive where the candidate's tokens taught less."""
        return self.candidate.loss - self.current.loss

    @property
    def speedup(self) -> float:
        """Current over candidate steady seconds for the same samples (above 1: the candidate is faster)."""
        return self.current.steady_seconds / self.candidate.steady_seconds


def probe_samples(requested: int, current_gbs: int, candidate_gbs: int) -> int:
    """Samples a probe trains per branch: ``requested`` rounded up to whole steps of both batches."""
    if requested < 1:
        raise PlanError(f"training.probe_samples must be positive, got {requested}")
    step = math.lcm(current_gbs, candidate_gbs)
    return -(-requested // step) * step


def judge(
    *, start_loss: float, current: BranchRun, candidate: BranchRun, tolerance: float
) -> tuple[Winner, str]:
    """The branch the run continues from, and why (see the module docstring)."""
    difference = candidate.loss - current.loss
    speed = current.steady_seconds / candidate.steady_seconds if candidate.steady_seconds > 0 else 0.0
    numbers = (
        f"probe loss {candidate.loss:.4f} at gbs {candidate.gbs} vs {current.loss:.4f} at gbs {current.gbs} "
        f"({difference:+.4f} nats, tolerance {tolerance:g}); the candidate trains the same samples "
        f"{speed:.3f}x as fast"
    )
    if not (math.isfinite(candidate.loss) and candidate.steady_seconds > 0):
        return "current", f"{numbers}: the candidate's branch did not finish finite"
    if abs(difference) <= tolerance:
        if candidate.steady_seconds < current.steady_seconds:
            return "candidate", f"{numbers}: equal loss within the tolerance, and faster"
        return "current", f"{numbers}: equal loss within the tolerance, and not faster"
    current_rate = (start_loss - current.loss) / current.steady_seconds
    candidate_rate = (start_loss - candidate.loss) / candidate.steady_seconds
    words = f"loss drop {candidate_rate:.4g} vs {current_rate:.4g} nats/s"
    if candidate_rate > current_rate:
        return "candidate", f"{numbers}: {words}, the candidate's is larger"
    return "current", f"{numbers}: {words}, the candidate's is not larger"
