"""The live console's text, without a terminal: progress toward the stop rule, ETA, units, and how far the
best online candidate is from a switch."""

from __future__ import annotations

import dataclasses
import math

import pytest

from cona.engine.metrics import format_console_line
from cona.runner.views.console_format import (
    StageSnapshot,
    StopRule,
    candidate_text,
    eta_s,
    format_duration,
    format_percent,
    format_si,
    metric_fields,
    plain_line,
    progress_text,
    stage_progress,
    summary_line,
    switch_threshold,
)

SEQ = 128


def record(iteration: int, time: float, *, steps: int = 2, gbs: int = 8, start_tokens: int = 0, **extra):
    """A metrics record of a stage of constant gbs that started at iteration 10 with ``start_tokens``."""
    return {
        "stage": 2,
        "iteration": iteration,
        "consumed_samples": (iteration - 10) * gbs,
        "consumed_tokens": start_tokens + (iteration - 10) * gbs * SEQ,
        "loss": 5.25,
        "lr": 1e-3,
        "gbs": gbs,
        "step_time_s": 2.0,
        "tokens_per_s": gbs * SEQ / 2.0,
        "mfu": None,
        "grad_norm": 1.5,
        "steps_in_interval": steps,
        "time": time,
        **extra,
    }


def snapshot(first=None, last=None, *, target_iteration=20, max_tokens=None, **extra) -> StageSnapshot:
    return StageSnapshot(
        stage=2,
        strategy="dp2 tp1 pp2 mbs2 gbs8",
        rule=StopRule(target_iteration=target_iteration, max_tokens=max_tokens),
        seq=SEQ,
        launched_at=1000.0,
        first=first,
        last=last,
        **extra,
    )


def test_progress_spans_the_stage_from_its_start_to_the_stop_iteration():
    first, last = record(12, 1010.0), record(15, 1016.0, steps=3)
    progress = stage_progress(snapshot(first, last))
    assert (progress.unit, progress.start, progress.done, progress.stop) == ("it", 10, 15, 20)
    assert progress.fraction == 0.5 and progress.remaining == 5
    assert progress_text(progress) == "iteration 15 in 10->20 (50%)"
    assert (
        stage_progress(snapshot()) is None
        and progress_text(None) == "starting (until the first log interval)"
    )


def test_progress_follows_the_rule_nearer_to_ending_the_stage():
    first = record(12, 1010.0, start_tokens=100_000)
    last = record(14, 1014.0, start_tokens=100_000)  # 40% of the iterations, 80% of the token span
    both = snapshot(first, last, target_iteration=20, max_tokens=100_000 + 5 * 8 * SEQ)
    progress = stage_progress(both)
    assert progress.unit == "tokens" and progress.start == 100_000
    assert progress.fraction == pytest.approx(0.8)
    assert progress_text(progress) == "tokens 104k in 100k->105k (80%)"
    tokens_only = stage_progress(snapshot(first, last, target_iteration=None, max_tokens=200_000))
    assert tokens_only.unit == "tokens" and tokens_only.fraction == pytest.approx(4096 / 100_000)


def test_progress_fraction_is_clamped_and_an_empty_span_is_done():
    beyond = stage_progress(snapshot(record(12, 1010.0), record(24, 1020.0), target_iteration=20))
    assert beyond.fraction == 1.0 and beyond.remaining == 0


def test_eta_uses_the_rate_between_the_stage_records_minus_the_time_since_the_last():
    first, last = record(12, 1010.0), record(16, 1020.0)  # 0.4 it/s, 4 iterations left
    assert eta_s(snapshot(first, last), now=1020.0) == pytest.approx(10.0)
    assert eta_s(snapshot(first, last), now=1023.0) == pytest.approx(7.0)
    assert eta_s(snapshot(first, last), now=1100.0) == 0.0  # late, never negative
    assert eta_s(snapshot(), now=1020.0) is None


def test_eta_of_a_single_record_uses_its_step_time_in_the_rules_unit():
    only = record(12, 1010.0)
    assert eta_s(snapshot(only, only), now=1010.0) == pytest.approx(8 * 2.0)
    tokens = snapshot(only, only, target_iteration=None, max_tokens=2 * 8 * SEQ + 10 * 8 * SEQ)
    assert eta_s(tokens, now=1010.0) == pytest.approx(10 * 2.0)
    stalled = {**only, "step_time_s": 0.0}
    assert eta_s(snapshot(stalled, stalled), now=1010.0) is None


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0, "0"),
        (5.5, "5.50"),
        (338.245, "338"),
        (1_234, "1.23k"),
        (12_345, "12.3k"),
        (460_800, "461k"),
        (999_700, "1.00M"),
        (2_500_000_000, "2.50G"),
        (None, "-"),
        (math.nan, "-"),
    ],
)
def test_format_si(value, text):
    assert format_si(value) == text


def test_durations_percentages_and_units():
    assert format_si(1_234, "tokens/s") == "1.23k tokens/s"
    assert [format_duration(s) for s in (0, 7.4, 725, 10_929)] == ["0:00", "0:07", "12:05", "3:02:09"]
    assert format_duration(None) == "-" and format_duration(math.inf) == "-"
    assert format_percent(0.4567) == "45.7%" and format_percent(None) == "-"


def decision(**changes):
    """A 'stay' decision of the policy with a candidate: goodput 500 -> 536.5 (+7.3%)."""
    base = {
        "stage": 2,
        "iteration": 40,
        "decision": "stay",
        "reason": "candidate makes 1.073x the progress per second; would save ...",
        "current": {"strategy": {"dp": 4, "tp": 1, "pp": 1, "mbs": 4, "gbs": 16}, "progress_per_s": 500.0},
        "candidate": {
            "strategy": {"dp": 2, "tp": 2, "pp": 1, "mbs": 8, "gbs": 32},
            "progress_per_s": 536.5,
        },
        "switch_cost_s": 50.0,
        "remaining_s": 1000.0,
    }
    return {**base, **changes}


def test_switch_threshold_solves_the_policys_rule_for_the_gain():
    # (1 - 1/(1+g)) x 1000 s > 50 s x 1.05  <=>  g > 1/(1 - 0.0525) - 1
    assert switch_threshold(decision(), 0.05) == pytest.approx(1 / 0.9475 - 1)
    assert switch_threshold(decision(remaining_s=40.0), 0.05) == math.inf
    assert switch_threshold(decision(remaining_s=None), 0.05) is None


def test_candidate_text_says_how_far_the_best_candidate_is_from_winning():
    assert candidate_text(decision()) == "dp2 tp2 pp1 mbs8 gbs32, +7.3% goodput (switch at +5.5%)"
    assert candidate_text(decision(hysteresis=0.5)) == (
        "dp2 tp2 pp1 mbs8 gbs32, +7.3% goodput (switch at +8.1%)"  # 1/(1 - 75/1000) - 1
    )
    assert candidate_text(decision(remaining_s=40.0)).endswith(
        "(a switch no longer pays back in the time left)"
    )
    assert candidate_text(decision(decision="switch")) == "dp2 tp2 pp1 mbs8 gbs32: switching"
    assert candidate_text(decision(decision="probe")) == "dp2 tp2 pp1 mbs8 gbs32: probing"
    unknown = decision(candidate=None, reason="noise scale unknown: 3 of 10 measurements needed")
    assert candidate_text(unknown) == "none (noise scale unknown: 3 of 10 measurements needed)"
    fallback = decision(
        decision="fallback", fallback_candidate={"strategy": {"dp": 4, "tp": 1, "pp": 1, "mbs": 2, "gbs": 8}}
    )
    assert candidate_text(fallback) == "falling back to dp4 tp1 pp1 mbs2 gbs8"
    assert candidate_text(None) is None


def test_the_noise_scale_names_the_floor_the_decisions_assume():
    floored = snapshot(record(12, 1010.0), record(14, 1014.0), noise_scale=1.34, decision=decision())
    assert dict(metric_fields(floored))["noise scale"] == "1.34 samples"
    floored = dataclasses.replace(floored, decision=decision(noise_scale_floor=64.0))
    assert dict(metric_fields(floored))["noise scale"] == "1.34 samples (decisions assume >= 64)"


def test_plain_line_extends_the_workers_console_line():
    first, last = record(12, 1010.0), record(16, 1020.0, eval_loss=5.5, eval_ppl=244.69)
    snap = snapshot(first, last, last_eval=last, noise_scale=12.34)
    line = plain_line(snap, last, now=1020.0)
    assert line == (
        f"{format_console_line(last)} | noise scale 12.3 samples | iteration 16 in 10->20 (60%) | eta 0:10"
    )
    assert line.startswith("stage 2 iter     16 | loss 5.2500") and "\x1b" not in line


def test_summary_line_names_the_stage_and_its_last_numbers():
    last = record(20, 1050.0, eval_loss=5.5, eval_ppl=244.69)
    snap = snapshot(record(12, 1010.0), last, last_eval=last, noise_scale=None)
    assert summary_line(snap, now=1065.0) == (
        "stage 2 (dp2 tp1 pp2 mbs2 gbs8) ended after 1:05 at iteration 20: loss 5.2500, "
        "eval ppl 244.69 (it 20), tokens/s 512, noise scale unknown"
    )
    assert summary_line(snapshot(), now=1003.0) == (
        "stage 2 (dp2 tp1 pp2 mbs2 gbs8) ended after 0:03 without logging"
    )
