"""The PNG figures of ``cona report`` (matplotlib, Agg, no pyplot state). Several runs share each figure,
one colour per run; a switch is a dashed vertical line labelled with the strategy it switched to.

Each ``draw_*`` function returns the file it wrote, or None when no run has the data it plots.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import EngFormatter

from cona.planner.efficiency import MIN_SAMPLES
from cona.runner.views.report import (
    SWITCH_PARTS,
    RunData,
    StageSummary,
    charged_switch_costs,
    noise_series,
    predicted_throughput,
    run_start_time,
    stage_summaries,
    switch_costs,
)
from cona.runner.views.report_axes import SwitchLabel, draw_switch_labels, label_log_axis, legend_beside

DPI = 110
SWITCH_STYLE = {"linestyle": "--", "linewidth": 1.0, "alpha": 0.8}
PART_NAMES = {
    "probe_s": "probe loss before save",
    "save_s": "save",
    "publish_s": "publish",
    "process_start_s": "process start",
    "load_s": "load (build + data + checkpoint)",
    "verify_s": "switch check after load",
    "first_step_s": "first step",
}
FIGURE_NAMES = (
    "loss_vs_time",
    "loss_vs_tokens",
    "strategy_timeline",
    "noise_scale",
    "throughput",
    "switch_costs",
)


def run_colors(count: int) -> list[str]:
    return [f"C{index % 10}" for index in range(count)]


def draw_all(runs: Sequence[RunData], out_dir: Path) -> dict[str, Path]:
    """Every figure the runs have data for, by name (see :data:`FIGURE_NAMES`)."""
    stages = [stage_summaries(run) for run in runs]
    unit, divisor = _time_unit(runs, stages)
    drawers: dict[str, Callable[[], Figure | None]] = {
        "loss_vs_time": lambda: _loss_figure(runs, stages, axis="time", unit=unit, divisor=divisor),
        "loss_vs_tokens": lambda: _loss_figure(runs, stages, axis="tokens", unit=unit, divisor=divisor),
        "strategy_timeline": lambda: _strategy_figure(runs, stages, unit=unit, divisor=divisor),
        "noise_scale": lambda: _noise_figure(runs),
        "throughput": lambda: _throughput_figure(runs, stages),
        "switch_costs": lambda: _switch_cost_figure(runs),
    }
    written = {}
    for name, draw in drawers.items():
        figure = draw()
        if figure is not None:
            path = out_dir / f"{name}.png"
            figure.savefig(path, dpi=DPI)
            written[name] = path
    return written


def _time_unit(runs: Sequence[RunData], stages: Sequence[Sequence[StageSummary]]) -> tuple[str, float]:
    """Seconds, minutes or hours, whichever keeps the longest run's axis readable."""
    longest = 0.0
    for run, run_stages in zip(runs, stages, strict=True):
        start = run_start_time(run)
        if start is not None and run_stages:
            longest = max(longest, run_stages[-1].end_time - start)
    if longest < 180:
        return "s", 1.0
    return ("min", 60.0) if longest < 3 * 3600 else ("h", 3600.0)


def _elapsed(run: RunData, times: np.ndarray, divisor: float) -> np.ndarray:
    start = run_start_time(run) or 0.0
    return (times - start) / divisor


def _column(records: Sequence[dict], key: str) -> np.ndarray:
    return np.array([np.nan if record.get(key) is None else float(record[key]) for record in records])


def _loss_figure(
    runs: Sequence[RunData], stages: Sequence[Sequence[StageSummary]], *, axis: str, unit: str, divisor: float
) -> Figure | None:
    if not any(run.metrics for run in runs):
        return None
    has_eval = any(record.get("eval_ppl") is not None for run in runs for record in run.metrics)
    figure = Figure(figsize=(9, 6.5 if has_eval else 4), layout="constrained")
    axes = figure.subplots(2 if has_eval else 1, 1, sharex=True, squeeze=False)[:, 0]
    colors = run_colors(len(runs))
    switch_labels: list[SwitchLabel] = []
    for run, run_stages, color in zip(runs, stages, colors, strict=True):
        x, loss = _x_values(run, run.metrics, axis, divisor), _column(run.metrics, "loss")
        if axis == "time":  # no line across a switch's downtime: nothing trained then
            x, loss = _break_at_stages(run.metrics, x, loss)
        dots = {"marker": "o", "markersize": 2.5} if len(run.metrics) <= 60 else {}  # few points: show them
        axes[0].plot(x, loss, color=color, linewidth=1.4, label=run.name, **dots)
        if has_eval:
            evals = [record for record in run.metrics if record.get("eval_ppl") is not None]
            x, ppl = _x_values(run, evals, axis, divisor), _column(evals, "eval_ppl")
            if axis == "time":
                x, ppl = _break_at_stages(evals, x, ppl)
            axes[1].plot(x, ppl, "o-", color=color, markersize=4)
            _label_last_value(axes[1], x, ppl, color)
        for ax in axes:
            _mark_switches(ax, run, run_stages, axis=axis, divisor=divisor, color=color)
        switch_labels += _switch_labels(axes[0], run, run_stages, axis=axis, divisor=divisor, color=color)
    axes[0].set_ylabel("training loss (nats/token)")
    if has_eval:
        axes[1].set_ylabel("eval perplexity")
        axes[1].set_yscale("log")
        label_log_axis(axes[1])
    _x_axis(axes[-1], axis, unit)
    switched = any(len(run_stages) > 1 for run_stages in stages)
    title = f"Loss vs {'wall time' if axis == 'time' else 'tokens'}"
    axes[0].set_title(title + (" (dashed: switch to the labelled strategy)" if switched else ""))
    switch_label = "switch (shaded: downtime)" if axis == "time" else "switch"
    handles = _run_handles(runs, colors, switch_label=switch_label if switched else None)
    legend_beside(axes[0], handles, fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3)
    draw_switch_labels(figure, switch_labels)
    return figure


def _label_last_value(ax: Axes, x: np.ndarray, y: np.ndarray, color: str) -> None:
    """The run's last finite value written beside its last point (the value the run ended at)."""
    finite = np.flatnonzero(np.isfinite(x) & np.isfinite(y))
    if len(finite):
        last = finite[-1]
        ax.annotate(
            f"{y[last]:.4g}", (x[last], y[last]), xytext=(5, 0), textcoords="offset points",
            va="center", fontsize=7, color=color,
        )  # fmt: skip


def _x_values(run: RunData, records: Sequence[dict], axis: str, divisor: float) -> np.ndarray:
    if axis == "tokens":
        return _column(records, "consumed_tokens")
    return _elapsed(run, _column(records, "time"), divisor)


def _break_at_stages(records: Sequence[dict], x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The series with a NaN between consecutive records of different stages (matplotlib leaves a gap)."""
    stages = _column(records, "stage")
    cuts = np.flatnonzero(stages[1:] != stages[:-1]) + 1
    return np.insert(x, cuts, np.nan), np.insert(y, cuts, np.nan)


def _x_axis(ax: Axes, axis: str, unit: str) -> None:
    if axis == "tokens":
        ax.set_xlabel("tokens consumed")
        ax.xaxis.set_major_formatter(EngFormatter(sep=""))
    else:
        ax.set_xlabel(f"wall time since the run started ({unit})")


def _mark_switches(
    ax: Axes,
    run: RunData,
    stages: Sequence[StageSummary],
    *,
    axis: str,
    divisor: float,
    color: str,
) -> None:
    """A dashed line where each stage after the first began; on the time axis the switch's downtime (end of
    the old stage's training to the end of the new stage's first step) is shaded."""
    for previous, stage in zip(stages, stages[1:], strict=False):
        x = _switch_x(run, previous, axis, divisor)
        if axis == "time":
            end = float(_elapsed(run, np.array([stage.ready_time]), divisor)[0])
            ax.axvspan(x, end, color=color, alpha=0.12, linewidth=0)
        ax.axvline(x, color=color, **SWITCH_STYLE)


def _switch_x(run: RunData, previous: StageSummary, axis: str, divisor: float) -> float:
    """Where the switch out of ``previous`` is drawn: its last token, or the end of its training."""
    if axis == "tokens":
        return float(previous.end_tokens)
    return float(_elapsed(run, np.array([previous.train_end]), divisor)[0])


def _switch_labels(
    ax: Axes, run: RunData, stages: Sequence[StageSummary], *, axis: str, divisor: float, color: str
) -> list[SwitchLabel]:
    """The strategy each stage after the first switched to, at its switch line (drawn last, spread out)."""
    return [
        SwitchLabel(ax=ax, x=_switch_x(run, previous, axis, divisor), text=stage.label, color=color)
        for previous, stage in zip(stages, stages[1:], strict=False)
    ]


def _run_handles(runs: Sequence[RunData], colors: Sequence[str], *, switch_label: str | None) -> list:
    """One legend entry per run, and one for the switch lines when ``switch_label`` is given."""
    handles: list = [
        Line2D([], [], color=color, label=run.name) for run, color in zip(runs, colors, strict=True)
    ]
    if switch_label is not None:
        handles.append(Line2D([], [], color="grey", label=switch_label, **SWITCH_STYLE))
    return handles


def _strategy_figure(
    runs: Sequence[RunData], stages: Sequence[Sequence[StageSummary]], *, unit: str, divisor: float
) -> Figure | None:
    if not any(stages):
        return None
    figure = Figure(figsize=(9, 3.2 + 0.6 * len(runs)), layout="constrained")
    gbs_ax, band_ax = figure.subplots(
        2, 1, sharex=True, gridspec_kw={"height_ratios": [2, 0.6 + 0.5 * len(runs)]}
    )
    colors = run_colors(len(runs))
    for row, (run, run_stages, color) in enumerate(zip(runs, stages, colors, strict=True)):
        for index, stage in enumerate(run_stages):
            start, end = _elapsed(run, np.array([stage.start_time, stage.end_time]), divisor)
            gbs_ax.hlines(stage.strategy["gbs"], start, end, color=color, linewidth=2.5)
            band_ax.barh(row, end - start, left=start, height=0.8, color=color, alpha=0.25, edgecolor=color)
            band_ax.text(
                (start + end) / 2,
                row + (0.18 if index % 2 else -0.18),  # staggered, so narrow neighbours do not overlap
                f"{stage.stage}: dp{stage.strategy['dp']} tp{stage.strategy['tp']} pp{stage.strategy['pp']}\n"
                f"mbs{stage.strategy['mbs']} gbs{stage.strategy['gbs']}",
                ha="center",
                va="center",
                fontsize=7,
            )
    gbs_ax.set_ylabel("global batch (samples)")
    gbs_ax.set_yscale("log", base=2)
    gbs_ax.yaxis.set_major_formatter(EngFormatter(sep=""))
    gbs_ax.set_title("Global batch and layout over time (a band per stage: its process start to its save)")
    legend_beside(gbs_ax, _run_handles(runs, colors, switch_label=None), fontsize=8)
    gbs_ax.grid(alpha=0.3)
    gbs_ax.margins(x=0.03)
    band_ax.set_yticks(range(len(runs)), [run.name for run in runs], fontsize=8)
    band_ax.set_ylim(len(runs) - 0.45, -0.55)
    _x_axis(band_ax, "time", unit)
    return figure


def _noise_figure(runs: Sequence[RunData]) -> Figure | None:
    series = [noise_series(run) for run in runs]
    if not any(series):
        return None
    figure = Figure(figsize=(9, 6), layout="constrained")
    noise_ax, efficiency_ax = figure.subplots(2, 1, sharex=True)
    colors = run_colors(len(runs))
    for run, points, color in zip(runs, series, colors, strict=True):
        if not points:
            continue
        tokens = np.array([point.tokens for point in points])
        noise_ax.plot(
            tokens, [point.noise_scale for point in points], color=color, label=f"{run.name}: noise scale"
        )
        noise_ax.step(
            tokens,
            [point.gbs for point in points],
            where="pre",
            color=color,
            linestyle=":",
            label=f"{run.name}: gbs",
        )
        efficiency_ax.step(  # each value holds over the interval its record closes
            tokens, [point.efficiency for point in points], where="pre", color=color, label=run.name
        )
    noise_ax.set_ylabel("samples")
    noise_ax.set_yscale("log")
    label_log_axis(noise_ax)
    noise_ax.set_title(
        f"Gradient noise scale (smoothed two-batch estimate, from the {MIN_SAMPLES}th measurement) "
        "and the gbs in use",
        fontsize=11,
    )
    legend_beside(noise_ax, noise_ax.get_legend_handles_labels()[0], fontsize=8)
    efficiency_ax.axhline(1.0, color="grey", linewidth=0.8)
    efficiency_ax.set_ylabel("statistical efficiency\n(progress per sample vs base gbs)")
    efficiency_ax.set_title("Statistical efficiency of the gbs in use: (noise + base gbs) / (noise + gbs)")
    _x_axis(efficiency_ax, "tokens", "")
    for ax in (noise_ax, efficiency_ax):
        ax.grid(alpha=0.3)
    return figure


def _throughput_figure(runs: Sequence[RunData], stages: Sequence[Sequence[StageSummary]]) -> Figure | None:
    bars = []  # (run index, stage, measured, predicted)
    for index, (run, run_stages) in enumerate(zip(runs, stages, strict=True)):
        predicted = predicted_throughput(run, run_stages)
        bars += [(index, stage, stage.tokens_per_s, predicted.get(stage.stage)) for stage in run_stages]
    if not any(measured is not None for _, _, measured, _ in bars):
        return None
    figure = Figure(figsize=(max(7.0, 1.3 * len(bars) + 2), 4.5), layout="constrained")
    ax = figure.subplots()
    colors = run_colors(len(runs))
    positions = np.arange(len(bars))
    any_predicted = any(predicted is not None for _, _, _, predicted in bars)
    width = 0.38 if any_predicted else 0.6
    offset = width / 2 if any_predicted else 0.0
    for position, (index, _, measured, predicted) in zip(positions, bars, strict=True):
        if measured is not None:
            ax.bar(position - offset, measured, width, color=colors[index])
        if predicted is not None:
            ax.bar(position + offset, predicted, width, color="white", edgecolor=colors[index], hatch="//")
    tallest = max(value or 0.0 for _, _, measured, predicted in bars for value in (measured, predicted))
    ax.set_ylim(0, tallest * 1.3)  # room for the legend above the bars
    ax.set_xticks(positions, [_bar_label(runs, index, stage) for index, stage, _, _ in bars], fontsize=7)
    ax.set_ylabel("tokens / s")
    ax.yaxis.set_major_formatter(EngFormatter(sep=""))
    ax.set_title("Throughput per stage: measured vs predicted")
    handles = [
        Patch(color="grey", label="measured (median of the stage's log intervals)"),
        Patch(
            facecolor="white",
            edgecolor="grey",
            hatch="//",
            label="predicted (decisions.jsonl)"
            if any_predicted
            else "predicted: none recorded (no decisions.jsonl)",
        ),
    ]
    if len(runs) > 1:
        handles += [Patch(color=color, label=run.name) for run, color in zip(runs, colors, strict=True)]
    ax.legend(handles=handles, fontsize=8, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    return figure


def _bar_label(runs: Sequence[RunData], index: int, stage: StageSummary) -> str:
    prefix = f"{runs[index].name}\n" if len(runs) > 1 else ""
    strategy = stage.strategy
    return (
        f"{prefix}stage {stage.stage}\ndp{strategy['dp']} tp{strategy['tp']} pp{strategy['pp']}\n"
        f"mbs{strategy['mbs']} gbs{strategy['gbs']}"
    )


def _switch_cost_figure(runs: Sequence[RunData]) -> Figure | None:
    switches = [(run, cost) for run in runs for cost in switch_costs(run)]
    if not switches:
        return None
    figure = Figure(figsize=(max(6.0, 1.1 * len(switches) + 3), 4.5), layout="constrained")
    ax = figure.subplots()
    positions = np.arange(len(switches))
    bottoms = np.zeros(len(switches))
    for part_index, part in enumerate(SWITCH_PARTS):
        heights = np.array([cost.parts.get(part, 0.0) for _, cost in switches])
        if not heights.any():
            continue
        ax.bar(positions, heights, 0.6, bottom=bottoms, color=f"C{part_index}", label=PART_NAMES[part])
        bottoms += heights
    charged = [charged_switch_costs(run, stage_summaries(run)).get(cost.into_stage) for run, cost in switches]
    for position, value in zip(positions, charged, strict=True):
        if value is not None:
            ax.hlines(value, position - 0.36, position + 0.36, colors="black", linestyles="--", linewidth=1.5)
    tops = np.maximum(bottoms, [value or 0.0 for value in charged])
    for position, total, top in zip(positions, bottoms, tops, strict=True):
        ax.annotate(
            f"{total:.1f} s",
            (position, top),
            xytext=(0, 3),
            textcoords="offset points",
            ha="center",
            fontsize=8,
        )
    prefix = len(runs) > 1
    labels = [
        f"{run.name}\n" * prefix + f"stage {cost.into_stage - 1}\u2192{cost.into_stage}"
        for run, cost in switches
    ]
    ax.set_xticks(positions, labels, fontsize=8)
    ax.set_ylabel("seconds")
    ax.set_ylim(0, tops.max() * 1.15)
    ax.set_title("Switch cost by part (measured)")
    handles, names = ax.get_legend_handles_labels()
    handles, names = handles[::-1], names[::-1]  # top to bottom as stacked: the last part first
    if any(value is not None for value in charged):
        handles.append(Line2D([], [], color="black", linestyle="--", linewidth=1.5))
        names.append("cost the policy charged\n(decisions.jsonl)")
    ax.legend(handles, names, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(axis="y", alpha=0.3)
    return figure
