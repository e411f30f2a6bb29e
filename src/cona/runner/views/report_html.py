"""The HTML page of ``cona report``: one file with the figures embedded (base64, each linked to its PNG
beside the page) and the tables: stages, switch costs, decisions, and the warnings about unreadable lines."""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cona.runner.views.online_report import STAGE_COLUMNS_CAPTION
from cona.runner.views.report import (
    SWITCH_PARTS,
    RunData,
    predicted_throughput,
    run_start_time,
    stage_summaries,
    strategy_label,
    switch_costs,
)
from cona.runner.views.report_figures import PART_NAMES

PAGE_NAME = "index.html"
STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.85em; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: right; vertical-align: top; }
th { background: #f2f2f2; } td.text { text-align: left; }
img { max-width: 100%; border: 1px solid #eee; }
.warnings { background: #fff4e5; border-left: 4px solid #f0a000; padding: 0.5em 1em; }
"""
FIGURE_CAPTIONS = {
    "loss_vs_time": "Training loss and eval perplexity against wall time.",
    "loss_vs_tokens": "Training loss and eval perplexity against tokens consumed.",
    "strategy_timeline": "Global batch size and parallel layout of each stage over time.",
    "noise_scale": "Gradient noise scale and statistical efficiency over tokens.",
    "throughput": "Measured and predicted throughput of each stage.",
    "switch_costs": "What each switch cost, by part.",
}


def write_html(
    runs: Sequence[RunData], figures: dict[str, Path], out_dir: Path, warnings: Sequence[str]
) -> Path:
    names = ", ".join(run.name for run in runs)
    parts = [
        "<!DOCTYPE html>",
        f"<html><head><meta charset='utf-8'><title>CONA report: {_esc(names)}</title>",
        f"<style>{STYLE}</style></head><body>",
        f"<h1>CONA report: {_esc(names)}</h1>",
        f"<p>Written {datetime.now(UTC):%Y-%m-%d %H:%M} UTC from {_run_list(runs)}.</p>",
    ]
    if warnings:
        items = "".join(f"<li>{_esc(warning)}</li>" for warning in warnings)
        parts.append(f"<div class='warnings'><b>Some of the run could not be read:</b><ul>{items}</ul></div>")
    parts += ["<h2>Stages</h2>", _stage_table(runs)]
    for name, path in figures.items():
        parts.append(_figure(name, path))
    parts += ["<h2>Switch costs</h2>", _switch_table(runs)]
    parts += ["<h2>Decisions</h2>", *(_decision_table(run, len(runs) > 1) for run in runs)]
    parts.append("</body></html>")
    page = out_dir / PAGE_NAME
    page.write_text("\n".join(parts) + "\n")
    return page


def _esc(value: Any) -> str:
    return html.escape(str(value))


def _run_list(runs: Sequence[RunData]) -> str:
    return ", ".join(f"<code>{_esc(run.run_dir)}</code>" for run in runs)


def _figure(name: str, path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    caption = FIGURE_CAPTIONS.get(name, name)
    return (
        f"<figure id='{name}'><a href='{_esc(path.name)}'>"
        f"<img src='data:image/png;base64,{data}' alt='{_esc(path.name)}'></a>"
        f"<figcaption>{_esc(caption)} (<a href='{_esc(path.name)}'>{_esc(path.name)}</a>)</figcaption>"
        "</figure>"
    )


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]], text_columns: set[int]) -> str:
    head = "".join(f"<th>{_esc(header)}</th>" for header in headers)
    body = []
    for row in rows:
        cells = "".join(
            f"<td class='text'>{_esc(_fmt(cell))}</td>"
            if index in text_columns
            else f"<td>{_esc(_fmt(cell))}</td>"
            for index, cell in enumerate(row)
        )
        body.append(f"<tr>{cells}</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _fmt(value: Any) -> str:
    if value is None:
        return "\u2013"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    if isinstance(value, dict):
        return ", ".join(f"{key}={_fmt(item)}" for key, item in value.items())
    if isinstance(value, list):
        return ", ".join(_fmt(item) for item in value)
    return str(value)


def _stage_table(runs: Sequence[RunData]) -> str:
    headers = ["run", "stage", "strategy", "iterations", "tokens", "wall s", "tokens/s"]
    headers += ["predicted tokens/s", "last eval ppl", "stopped"]
    rows = []
    for run in runs:
        stages = stage_summaries(run)
        predicted = predicted_throughput(run, stages)
        for stage in stages:
            rows.append(
                [
                    run.name,
                    stage.stage,
                    stage.label,
                    f"{stage.first_iteration}\u2013{stage.last_iteration}",
                    stage.end_tokens - stage.start_tokens,
                    stage.wall_s,
                    stage.tokens_per_s,
                    predicted.get(stage.stage),
                    stage.last_eval_ppl,
                    stage.reason or "running",
                ]
            )
    if not rows:
        return "<p>No metrics yet.</p>"
    return _table(headers, rows, {0, 2, 3, 9}) + f"<p>{html.escape(STAGE_COLUMNS_CAPTION)}.</p>"


def _switch_table(runs: Sequence[RunData]) -> str:
    headers = ["run", "switch", *(PART_NAMES[part] + " (s)" for part in SWITCH_PARTS), "total (s)", "from"]
    rows = []
    for run in runs:
        for cost in switch_costs(run):
            values = [cost.parts.get(part) for part in SWITCH_PARTS]
            switch = f"stage {cost.into_stage - 1} \u2192 {cost.into_stage}"
            rows.append([run.name, switch, *values, sum(cost.parts.values()), cost.source])
    return _table(headers, rows, {0, 1, len(headers) - 1}) if rows else "<p>No switches.</p>"


DECISION_HEADERS = (
    "time (s since start)", "iteration", "decision", "noise scale", "current", "measured tokens/s",
    "predicted / measured", "candidate", "predicted tokens/s", "progress/s current \u2192 candidate",
    "switch cost (s)", "time saved (s)", "reason",
)  # fmt: skip


def _decision_table(run: RunData, name_it: bool) -> str:
    """One row per line of decisions.jsonl (the fields of :mod:`cona.planner.policy`'s records that explain
    the decision; the file has them all)."""
    title = f"<h3>{_esc(run.name)}</h3>" if name_it else ""
    if not run.decisions:
        return f"{title}<p>No decisions recorded (no decisions.jsonl: not an online run).</p>"
    start = run_start_time(run)
    rows = [_decision_row(decision, start) for decision in run.decisions]
    return title + _table(DECISION_HEADERS, rows, {2, 4, 7, 9, 10, 12})


def _decision_row(decision: dict[str, Any], start: float | None) -> list[Any]:
    current = decision.get("current") if isinstance(decision.get("current"), dict) else {}
    candidate = decision.get("candidate") if isinstance(decision.get("candidate"), dict) else {}
    moment = decision.get("time")
    progress = f"{_fmt(current.get('progress_per_s'))} \u2192 {_fmt(candidate.get('progress_per_s'))}"
    cost = decision.get("switch_cost_s")
    cost_text = (
        f"{_fmt(cost)} ({decision['switch_cost_source']})" if decision.get("switch_cost_source") else cost
    )
    return [
        moment - start if isinstance(moment, int | float) and start is not None else moment,
        decision.get("iteration"),
        decision.get("decision"),
        decision.get("noise_scale"),
        _strategy_text(current.get("strategy")),
        current.get("measured_tokens_per_s"),
        decision.get("predicted_over_measured"),
        _strategy_text(candidate.get("strategy")),
        candidate.get("predicted_tokens_per_s"),
        progress if candidate else _fmt(current.get("progress_per_s")),
        cost_text,
        decision.get("time_saved_s"),
        decision.get("reason"),
    ]


def _strategy_text(strategy: Any) -> str | None:
    return strategy_label(strategy) if isinstance(strategy, dict) else None
