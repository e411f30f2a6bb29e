"""The text of the live console (pure functions, no terminal): where a stage stands toward its stop rule,
its ETA, the numbers of its last log interval, and in online mode how far the best candidate is from a switch.

Everything is computed from a :class:`StageSnapshot` (what the runner has read from ``metrics.jsonl`` and
``decisions.jsonl`` so far) and the current time, so the same snapshot always gives the same text.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from cona.engine.metrics import eval_ppl_label, format_console_line
from cona.planner.policy import DEFAULT_HYSTERESIS
from cona.runner.views.report import strategy_label

Record = Mapping[str, Any]
_FINITE_IN_WORKER = ("loss", "lr", "step_time_s", "tokens_per_s", "grad_norm")
"""Numbers the metrics file writes as null when they were NaN or infinite (JSON has neither)."""
_SI_PREFIXES = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


@dataclass(frozen=True, kw_only=True)
class StopRule:
    """When a stage stops (absolute counts, as in its spec): at an iteration, at a token count, or at
    whichever comes first."""

    target_iteration: int | None
    max_tokens: int | None


@dataclass(frozen=True, kw_only=True)
class Progress:
    """A stage's position between where it started and where its stop rule ends it, in one unit."""

    unit: Literal["it", "tokens"]
    start: float
    done: float
    stop: float

    @property
    def fraction(self) -> float:
        """Share of the stage done, in [0, 1] (1 for a stage that had nothing to do)."""
        span = self.stop - self.start
        if span <= 0:
            return 1.0
        return min(max((self.done - self.start) / span, 0.0), 1.0)

    @property
    def remaining(self) -> float:
        return max(self.stop - self.done, 0.0)


@dataclass(frozen=True, kw_only=True)
class StageSnapshot:
    """What the console knows about the running stage."""

    stage: int
    strategy: str
    """``dp2 tp1 pp2 mbs2 gbs8``."""
    rule: StopRule
    seq: int
    """Tokens per sample, to place the stage's start in tokens."""
    launched_at: float
    first: Record | None = None
    """The stage's first metrics record (of this attempt); None until it is logged."""
    last: Record | None = None
    last_eval: Record | None = None
    """The run's newest record with an evaluation (an earlier stage's until this one evaluates)."""
    noise_scale: float | None = None
    """The gradient noise scale (samples) measured so far in the run; None while unknown."""
    decision: Record | None = None
    """The newest online decision of the stage (a ``decisions.jsonl`` line); None outside online mode."""


def stage_start(first: Record, seq: int) -> tuple[int, int]:
    """(iteration, consumed tokens) at which the stage started: its first record minus that record's
    interval (the interval counts only this stage's steps, also after a resume mid-interval)."""
    steps = int(first.get("steps_in_interval", 0))
    iteration = int(first["iteration"]) - steps
    tokens = int(first["consumed_tokens"]) - steps * int(first["gbs"]) * seq
    return iteration, tokens


def stage_progress(snapshot: StageSnapshot) -> Progress | None:
    """Progress toward the stop rule that is nearer to ending the stage; None before the first record."""
    first, last = snapshot.first, snapshot.last
    if first is None or last is None:
        return None
    start_iteration, start_tokens = stage_start(first, snapshot.seq)
    candidates = []
    if snapshot.rule.target_iteration is not None:
        candidates.append(
            Progress(
                unit="it",
                start=start_iteration,
                done=int(last["iteration"]),
                stop=snapshot.rule.target_iteration,
            )
        )
    if snapshot.rule.max_tokens is not None:
        candidates.append(
            Progress(
                unit="tokens",
                start=start_tokens,
                done=int(last["consumed_tokens"]),
                stop=snapshot.rule.max_tokens,
            )
        )
    return max(candidates, key=lambda progress: progress.fraction, default=None)


def progress_rate(snapshot: StageSnapshot, unit: str) -> float | None:
    """Units per second over the stage's records so far (evaluations included, as they cost time too);
    from the last interval's step time while the stage has logged only once."""
    first, last = snapshot.first, snapshot.last
    if first is None or last is None:
        return None
    key = "iteration" if unit == "it" else "consumed_tokens"
    elapsed = float(last["time"]) - float(first["time"])
    if elapsed > 0:
        rate = (float(last[key]) - float(first[key])) / elapsed
        return rate if rate > 0 else None
    step_s = last.get("step_time_s")
    if not isinstance(step_s, int | float) or step_s <= 0:
        return None
    return 1.0 / step_s if unit == "it" else int(last["gbs"]) * snapshot.seq / step_s


def eta_s(snapshot: StageSnapshot, now: float) -> float | None:
    """Seconds until the stop rule ends the stage at the rate measured so far, counted from ``now`` (the
    time already spent since the last record is taken off); None when unknown."""
    progress = stage_progress(snapshot)
    if progress is None or snapshot.last is None:
        return None
    if progress.remaining == 0:
        return 0.0
    rate = progress_rate(snapshot, progress.unit)
    if rate is None:
        return None
    since_last = max(now - float(snapshot.last["time"]), 0.0)
    return max(progress.remaining / rate - since_last, 0.0)


def format_si(value: float | None, unit: str = "") -> str:
    """``512``, ``1.23k``, ``45.6M``: three significant digits with an SI prefix; ``-`` for None/NaN."""
    if value is None or not math.isfinite(value):
        return "-"
    suffix = f" {unit}" if unit else ""
    magnitude = abs(value)
    for size, prefix in _SI_PREFIXES:
        if magnitude >= size * 0.9995:  # 999_700 reads 1.00M, not 1000k
            return f"{_three_digits(value / size)}{prefix}{suffix}"
    return f"{_three_digits(value)}{suffix}"


def _three_digits(value: float) -> str:
    magnitude = abs(value)
    if magnitude >= 99.95 or value == int(value):
        return f"{value:.0f}"
    return f"{value:.1f}" if magnitude >= 9.995 else f"{value:.2f}"


def format_duration(seconds: float | None) -> str:
    """``0:07``, ``12:05``, ``3:02:09`` (h:mm:ss); ``-`` when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    total = max(int(round(seconds)), 0)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def format_percent(fraction: float | None) -> str:
    return "-" if fraction is None or not math.isfinite(fraction) else f"{100 * fraction:.1f}%"


def progress_text(progress: Progress | None) -> str:
    """``iteration 15 in 10->20 (50%)`` or ``tokens 61.4k in 51.2k->461k (2%)``: where the stage stands,
    the span from its start to its stop rule, and the share of that span done."""
    if progress is None:
        return "starting (until the first log interval)"
    if progress.unit == "it":
        counts = f"iteration {progress.done:.0f} in {progress.start:.0f}->{progress.stop:.0f}"
    else:
        span = f"{format_si(progress.start)}->{format_si(progress.stop)}"
        counts = f"tokens {format_si(progress.done)} in {span}"
    return f"{counts} ({100 * progress.fraction:.0f}%)"


def noise_text(noise_scale: float | None) -> str:
    return "unknown" if noise_scale is None else f"{format_si(noise_scale)} samples"


def eval_text(record: Record | None) -> str:
    if record is None or record.get("eval_ppl") is None:
        return "-"
    return f"{float(record['eval_ppl']):.2f} (it {record['iteration']})"


def metric_fields(snapshot: StageSnapshot) -> list[tuple[str, str]]:
    """(label, value) of the last interval: loss, eval perplexity, throughput, MFU, noise scale."""
    last = snapshot.last or {}
    loss = last.get("loss")
    return [
        ("loss", f"{loss:.4f}" if isinstance(loss, int | float) else "-"),
        (f"eval {eval_ppl_label(snapshot.last_eval or {})}", eval_text(snapshot.last_eval)),
        ("tokens/s", format_si(last.get("tokens_per_s"))),
        ("MFU", format_percent(last.get("mfu"))),
        ("noise scale", noise_text(snapshot.noise_scale) + _floor_note(snapshot.decision)),
    ]


def _floor_note(decision: Record | None) -> str:
    """The floor an online run's decisions assume in place of a smaller measured noise scale (the demo)."""
    floor = (decision or {}).get("noise_scale_floor")
    return f" (decisions assume >= {floor:g})" if isinstance(floor, int | float) else ""


def switch_threshold(decision: Record, hysteresis: float) -> float | None:
    """The goodput gain (candidate over current, minus 1) at which the policy would switch now, from the
    rule ``(1 - current / candidate) x remaining_s > switch_cost_s x (1 + hysteresis)``; ``inf`` when even
    an infinitely faster candidate could not win back the switch cost in the time left; None when the
    decision holds no remaining time."""
    remaining, cost = decision.get("remaining_s"), decision.get("switch_cost_s")
    if not isinstance(remaining, int | float) or not isinstance(cost, int | float):
        return None
    ratio_needed = 1.0 - cost * (1.0 + hysteresis) / remaining if remaining > 0 else 0.0
    return 1.0 / ratio_needed - 1.0 if ratio_needed > 0 else math.inf


def candidate_text(decision: Record | None) -> str | None:
    """How far the best candidate is from winning, e.g. ``dp2 tp1 pp1 mbs4 gbs128, +7.3% goodput (switch
    at +10.0%)``; None outside online mode. Goodput is progress per second in base-batch tokens (tokens/s
    x statistical efficiency), as the policy compares it."""
    if decision is None:
        return None
    action = decision.get("decision")
    if action == "fallback" and isinstance(decision.get("fallback_candidate"), Mapping):
        return f"falling back to {strategy_label(decision['fallback_candidate']['strategy'])}"
    candidate = decision.get("candidate")
    if not isinstance(candidate, Mapping):
        return f"none ({decision.get('reason', 'no candidate')})"
    label = strategy_label(candidate["strategy"])
    if action == "switch":
        return f"{label}: switching"
    if action == "probe":  # the noise-scale model's view is the prior only: the probe decides
        return f"{label}: probing"
    current_goodput = (decision.get("current") or {}).get("progress_per_s")
    goodput = candidate.get("progress_per_s")
    if not isinstance(current_goodput, int | float) or not isinstance(goodput, int | float):
        return label
    gain = goodput / current_goodput - 1.0
    threshold = switch_threshold(decision, float(decision.get("hysteresis", DEFAULT_HYSTERESIS)))
    if threshold is None:
        return f"{label}, {gain:+.1%} goodput"
    if math.isinf(threshold):
        return f"{label}, {gain:+.1%} goodput (a switch no longer pays back in the time left)"
    return f"{label}, {gain:+.1%} goodput (switch at {threshold:+.1%})"


def plain_line(snapshot: StageSnapshot, record: Record, now: float) -> str:
    """One line per log interval when stdout is not a terminal: the workers' console line (a stable,
    ``|``-separated format), then the noise scale, the stop rule's progress and the ETA."""
    parts = [
        format_console_line(as_worker_record(record)),
        f"noise scale {noise_text(snapshot.noise_scale)}",
        progress_text(stage_progress(snapshot)),
        f"eta {format_duration(eta_s(snapshot, now))}",
    ]
    return " | ".join(parts)


def as_worker_record(record: Record) -> dict[str, Any]:
    """The record as the worker had it before writing it as JSON: a diverged number (null in the file) is
    NaN again, and a perplexity that overflowed is infinite, so the console line reads ``nan``/``inf``."""
    restored: dict[str, Any] = {
        key: math.nan for key in _FINITE_IN_WORKER if key in record and record[key] is None
    }
    if record.get("eval_loss") is not None and record.get("eval_ppl") is None:
        restored["eval_ppl"] = math.inf
    return {**record, **restored}


def summary_line(snapshot: StageSnapshot, now: float) -> str:
    """The line a stage leaves behind when its workers exit."""
    last = snapshot.last
    elapsed = format_duration(now - snapshot.launched_at)
    if last is None:
        return f"stage {snapshot.stage} ({snapshot.strategy}) ended after {elapsed} without logging"
    fields = ", ".join(f"{label} {value}" for label, value in metric_fields(snapshot) if value != "-")
    return (
        f"stage {snapshot.stage} ({snapshot.strategy}) ended after {elapsed} at iteration "
        f"{last['iteration']}: {fields}"
    )
