"""Assertions on what the workers really did, read from their step trace (``CONA_STEP_TRACE=1``, see
:mod:`cona.engine.step_trace`), not rebuilt from the logged ``consumed_samples`` with the sampler.

The reference is computed here from first principles, so a bug in the sampler, the trainer's window or the
runner's LR factor cannot hide behind the code it would be checked with: an uninterrupted run trains the
global sample ids ``0, 1, 2, ...`` in order, each once, a step of gbs ``G`` taking the next ``G`` of them;
the LR of a step is the token-based schedule (linear warmup, cosine to the minimum) at the tokens consumed
before it, its peak and minimum scaled by the LR rule at the step's gbs.
"""

from __future__ import annotations

import math
from pathlib import Path

from cona.engine.step_trace import STEP_TRACE_ENV, TrainedStep, effective_steps, read_step_trace

TRACE_ENV = {STEP_TRACE_ENV: "1"}
"""The environment that switches the workers' step trace on."""
LR_RTOL = 1e-9


def trained_steps(run_dir: Path) -> list[TrainedStep]:
    steps = effective_steps(read_step_trace(run_dir))
    assert steps, f"no step trace under {run_dir}: was {STEP_TRACE_ENV}=1 set for the workers?"
    return steps


def assert_each_sample_once_in_order(run_dir: Path, *, total_samples: int) -> list[TrainedStep]:
    """Every iteration 1..N traced; together they trained ids 0..total_samples-1, each once, each step
    the next window after the one before (the order of an uninterrupted run). Returns the steps."""
    steps = trained_steps(run_dir)
    assert [step.iteration for step in steps] == list(range(1, len(steps) + 1)), "iterations not contiguous"
    start = 0
    for step in steps:
        window = tuple(range(start, start + len(step.sample_ids)))
        assert step.sample_ids == window, (
            f"iteration {step.iteration} (stage {step.stage}) trained ids {_short(step.sample_ids)}, "
            f"an uninterrupted run trains {_short(window)}"
        )
        start += len(step.sample_ids)
    assert start == total_samples, f"the run trained {start} samples, expected {total_samples}"
    return steps


def rule_factor(rule: str, gbs: int, base_gbs: int) -> float:
    scale = gbs / base_gbs
    return {"linear": scale, "sqrt": math.sqrt(scale), "none": 1.0}[rule]


def scheduled_lr(tokens: int, *, peak: float, minimum: float, warmup_tokens: int, decay_tokens: int) -> float:
    if tokens < warmup_tokens:
        return peak * tokens / warmup_tokens
    if tokens >= decay_tokens:
        return minimum
    progress = (tokens - warmup_tokens) / (decay_tokens - warmup_tokens)
    return minimum + (peak - minimum) * 0.5 * (1 + math.cos(math.pi * progress))


def assert_lr_follows_schedule(
    steps: list[TrainedStep], config: dict, *, rule: str, decay_tokens: int
) -> None:
    """The LR every step applied equals the schedule at the tokens before it, scaled by ``rule`` at the
    step's gbs (the minimum scaled too, as ``scale_min_lr`` does by default). ``config``: the raw
    ``.conaconfig`` (its seq, base LRs, base gbs and warmup tokens); ``decay_tokens``: the horizon."""
    seq, training = config["model"]["seq"], config["training"]
    base_lr, base_min_lr, base_gbs = training["base_lr"], training["base_min_lr"], training["base_gbs"]
    warmup_tokens = training["lr_warmup_tokens"]
    tokens = 0
    for step in steps:
        gbs = len(step.sample_ids)
        factor = rule_factor(rule, gbs, base_gbs)
        peak = base_lr * factor
        expected = scheduled_lr(
            tokens,
            peak=peak,
            minimum=min(base_min_lr * factor, peak),
            warmup_tokens=warmup_tokens,
            decay_tokens=decay_tokens,
        )
        assert math.isclose(step.lr, expected, rel_tol=LR_RTOL, abs_tol=1e-15), (
            f"iteration {step.iteration} (stage {step.stage}, gbs {gbs}): LR {step.lr!r} applied, "
            f"the {rule} rule's schedule gives {expected!r}"
        )
        tokens += gbs * seq


def _short(ids: tuple[int, ...]) -> str:
    return f"{ids[0]}..{ids[-1]} ({len(ids)})" if len(ids) > 4 else str(list(ids))
