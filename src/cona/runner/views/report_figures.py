"""The PNG figures of ``cona report`` (matplotlib, Agg, no pyplot state). Several runs share each figure,
one colour per run; a switch is a dashed vertical line tagged above the axes with the number of the stage it
led into, and the legend beside lists each run's stages with their strategies (the key to the tags and to
the timeline's bands). The bar figures give each run a row of its own.

Each figure's builder returns the figure, or None when no run has the data it plots; :func:`draw_figures`
collects them (the figure tests measure their texts), :func:`draw_all` writes them as PNGs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.text import Annotation
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
from cona.runner.views.report_axes import (
    SwitchTag,
    draw_switch_tags,
    final_layout,
    label_log_axis,
    legend_beside,
    separate_vertically,
    tag_room_pt,
)

DPI = 110
"""The figures' resolution: their texts are measured and placed at the resolution they are written at."""
KEY_FONTSIZE = 7.5
BAND_HEIGHT = 0.8
"""A timeline band's height (rows of the band axes)."""
BAND_MARGIN_PX = 8.0
"""Least room (pixels) between a band's label and its edges."""
BAR_ROW_IN = 3.0
"""Height of a run's row of bars (inches)."""
KEY_ENTRY_IN = 0.17
"""Height of one legend entry at :data:`KEY_FONTSIZE` (inches)."""
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
    """Write every figure the runs have data for (``<name>.png``); returns the files by name."""
    written = {}
    for name, figure in draw_figures(runs).items():
        path = out_dir / f"{name}.png"
        figure.savefig(path, dpi=DPI)
        written[name] = path
    return written


def draw_figures(runs: Sequence[RunData]) -> dict[str, Figure]:
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
    figures = {name: draw() for name, draw in drawers.items()}
    return {name: figure for name, figure in figures.items() if figure is not None}


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
    switched = any(len(run_stages) > 1 for run_stages in stages)
    colors = run_colors(len(runs))
    switch_label = "switch (shaded: downtime)" if axis == "time" else "switch"
    handles = _key_handles(runs, stages, colors, switch_label=switch_label if switched else None)
    figure = Figure(figsize=(9, _key_height(6.5 if has_eval else 4, handles)), layout="constrained", dpi=DPI)
    axes = figure.subplots(2 if has_eval else 1, 1, sharex=True, squeeze=False)[:, 0]
    tags: list[SwitchTag] = []
    last_values: list[Annotation] = []
    for row, (run, run_stages, color) in enumerate(zip(runs, stages, colors, strict=True)):
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
            last_values += _label_last_value(axes[1], x, ppl, color)
        for ax in axes:
            _mark_switches(ax, run, run_stages, axis=axis, divisor=divisor, color=color)
        tags += _switch_tags(axes[0], run, run_stages, axis=axis, divisor=divisor, color=color, row=row)
    axes[0].set_ylabel("training loss (nats/token)")
    if has_eval:
        axes[1].set_ylabel("eval perplexity")
        axes[1].set_yscale("log")
        label_log_axis(axes[1])
    _x_axis(axes[-1], axis, unit)
    title = f"Loss vs {'wall time' if axis == 'time' else 'tokens'}"
    rows = max((tag.row + 1 for tag in tags), default=0)
    title += " (dashed: a switch into the tagged stage)" if switched else ""
    axes[0].set_title(title, pad=tag_room_pt(rows))
    legend_beside(axes[0], handles, fontsize=KEY_FONTSIZE)
    for ax in axes:
        ax.grid(alpha=0.3)
    draw_switch_tags(figure, tags)
    separate_vertically(figure, last_values)
    return figure


def _label_last_value(ax: Axes, x: np.ndarray, y: np.ndarray, color: str) -> list[Annotation]:
    """The run's last finite value written beside its last point (the value the run ended at)."""
    finite = np.flatnonzero(np.isfinite(x) & np.isfinite(y))
    if not len(finite):
        return []
    last = finite[-1]
    return [
        ax.annotate(
            f"{y[last]:.4g}", (x[last], y[last]), xytext=(5, 0), textcoords="offset points",
            va="center", fontsize=7, color=color,
        )
    ]  # fmt: skip


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


def _switch_tags(
    ax: Axes, run: RunData, stages: Sequence[StageSummary], *, axis: str, divisor: float, color: str, row: int
) -> list[SwitchTag]:
    """The number of each stage after the first, over its switch line (drawn last, spread out)."""
    return [
        SwitchTag(
            ax=ax, x=_switch_x(run, previous, axis, divisor), text=str(stage.stage), color=color, row=row
        )
        for previous, stage in zip(stages, stages[1:], strict=False)
    ]


def _key_handles(
    runs: Sequence[RunData],
    stages: Sequence[Sequence[StageSummary]],
    colors: Sequence[str],
    *,
    switch_label: str | None,
) -> list:
    """The legend: each run's line, under it (when any run switched) its stages' numbers and strategies,
    then the switch line's entry when ``switch_label`` is given."""
    switched = any(len(run_stages) > 1 for run_stages in stages)
    handles: list = []
    for run, run_stages, color in zip(runs, stages, colors, strict=True):
        handles.append(Line2D([], [], color=color, label=run.name))
        if switched:
            handles += [
                Patch(facecolor="none", edgecolor="none", label=f"{stage.stage}: {stage.label}")
                for stage in run_stages
            ]
    if switch_label is not None:
        handles.append(Line2D([], [], color="grey", label=switch_label, **SWITCH_STYLE))
    return handles


def _key_height(height: float, handles: Sequence) -> float:
    """The figure's height (inches): ``height``, or more where the legend's entries need it."""
    return max(height, KEY_ENTRY_IN * len(handles) + 0.6)


def _strategy_figure(
    runs: Sequence[RunData], stages: Sequence[Sequence[StageSummary]], *, unit: str, divisor: float
) -> Figure | None:
    if not any(stages):
        return None
    colors = run_colors(len(runs))
    handles = _key_handles(runs, stages, colors, switch_label=None)
    figure = Figure(figsize=(9, _key_height(3.2 + 0.6 * len(runs), handles)), layout="constrained", dpi=DPI)
    gbs_ax, band_ax = figure.subplots(
        2, 1, sharex=True, gridspec_kw={"height_ratios": [2, 0.6 + 0.5 * len(runs)]}
    )
    bands = []
    for row, (run, run_stages, color) in enumerate(zip(runs, stages, colors, strict=True)):
        for stage in run_stages:
            start, end = _elapsed(run, np.array([stage.start_time, stage.end_time]), divisor)
            gbs_ax.hlines(stage.strategy["gbs"], start, end, color=color, linewidth=2.5)
            band_ax.barh(
                row, end - start, left=start, height=BAND_HEIGHT, color=color, alpha=0.25, edgecolor=color
            )
            bands.append((row, float(start), float(end), stage))
    gbs_ax.set_ylabel("global batch (samples)")
    gbs_ax.set_yscale("log", base=2)
    gbs_ax.yaxis.set_major_formatter(EngFormatter(sep=""))
    gbs_ax.set_title("Global batch and layout of each stage over time")
    legend_beside(gbs_ax, handles, fontsize=KEY_FONTSIZE)
    gbs_ax.grid(alpha=0.3)
    gbs_ax.margins(x=0.03)
    band_ax.set_yticks(range(len(runs)), [run.name for run in runs], fontsize=8)
    band_ax.set_ylim(len(runs) - 0.45, -0.55)
    _x_axis(band_ax, "time", unit)
    band_ax.set_xlabel(band_ax.get_xlabel() + "; a band: a stage, from its process start to its save")
    _label_bands(figure, band_ax, bands)
    return figure


def _label_bands(figure: Figure, ax: Axes, bands: Sequence[tuple[int, float, float, StageSummary]]) -> None:
    """Write in each band its stage's number and layout where they fit inside it, else its number alone,
    else nothing (the legend's key lists every stage)."""
    renderer = final_layout(figure)  # the bands' widths in pixels
    for row, start, end, stage in bands:
        (left, bottom), (right, top) = ax.transData.transform(
            [(start, row + BAND_HEIGHT / 2), (end, row - BAND_HEIGHT / 2)]
        )
        full = f"{stage.stage}: {stage.label.replace(' mbs', chr(10) + 'mbs')}"  # two lines: layout, batch
        for text in (full, str(stage.stage)):
            label = ax.text((start + end) / 2, row, text, ha="center", va="center", fontsize=7, clip_on=True)
            box = label.get_window_extent(renderer)
            if (
                box.width <= abs(right - left) - BAND_MARGIN_PX
                and box.height <= abs(top - bottom) - BAND_MARGIN_PX
            ):
                break
            label.remove()


def _noise_figure(runs: Sequence[RunData]) -> Figure | None:
    series = [noise_series(run) for run in runs]
    if not any(series):
        return None
    figure = Figure(figsize=(9, 6), layout="constrained", dpi=DPI)
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
    noise_ax.set_ylabel(f"samples\n(noise scale from the {MIN_SAMPLES}th measurement)")
    noise_ax.set_yscale("log")
    label_log_axis(noise_ax)
    noise_ax.set_title("Gradient noise scale (smoothed two-batch estimate) and the gbs in use", fontsize=11)
    legend_beside(noise_ax, noise_ax.get_legend_handles_labels()[0], fontsize=8)
    efficiency_ax.axhline(1.0, color="grey", linewidth=0.8)
    efficiency_ax.set_ylabel("statistical efficiency\n(progress per sample vs base gbs)")
    efficiency_ax.set_title("Statistical efficiency of the gbs in use: (noise + base gbs) / (noise + gbs)")
    _x_axis(efficiency_ax, "tokens", "")
    for ax in (noise_ax, efficiency_ax):
        ax.grid(alpha=0.3)
    return figure


def _throughput_figure(runs: Sequence[RunData], stages: Sequence[Sequence[StageSummary]]) -> Figure | None:
    rows = []  # (run index, [(stage, measured, predicted)])
    for index, (run, run_stages) in enumerate(zip(runs, stages, strict=True)):
        predicted = predicted_throughput(run, run_stages)
        bars = [(stage, stage.tokens_per_s, predicted.get(stage.stage)) for stage in run_stages]
        if any(measured is not None for _, measured, _ in bars):
            rows.append((index, bars))
    if not rows:
        return None
    any_predicted = any(predicted is not None for _, bars in rows for _, _, predicted in bars)
    width = 0.38 if any_predicted else 0.6
    offset = width / 2 if any_predicted else 0.0
    colors = run_colors(len(runs))
    figure, axes = _bar_rows(runs, [index for index, _ in rows], max(len(bars) for _, bars in rows), 1.3)
    for ax, (index, bars) in zip(axes, rows, strict=True):
        positions = np.arange(len(bars))
        for position, (_, measured, predicted) in zip(positions, bars, strict=True):
            if measured is not None:
                ax.bar(position - offset, measured, width, color=colors[index])
            if predicted is not None:
                ax.bar(
                    position + offset, predicted, width, color="white", edgecolor=colors[index], hatch="//"
                )
        ax.set_xticks(positions, [_bar_label(stage) for stage, _, _ in bars], fontsize=7)
        ax.set_ylabel("tokens / s")
        ax.yaxis.set_major_formatter(EngFormatter(sep=""))
    _title_rows(figure, axes, "Throughput per stage: measured vs predicted")
    predicted_label = "predicted (decisions.jsonl)" if any_predicted else "predicted: none recorded"
    handles = [
        Patch(color="grey", label="measured (median of the stage's\nsteady log intervals)"),
        Patch(facecolor="white", edgecolor="grey", hatch="//", label=predicted_label),
    ]
    legend_beside(axes[0], handles, fontsize=8)
    return figure


def _bar_label(stage: StageSummary) -> str:
    strategy = stage.strategy
    return (
        f"stage {stage.stage}\ndp{strategy['dp']} tp{strategy['tp']} pp{strategy['pp']}\n"
        f"mbs{strategy['mbs']} gbs{strategy['gbs']}"
    )


def _bar_rows(
    runs: Sequence[RunData], indices: Sequence[int], slots: int, slot_in: float
) -> tuple[Figure, list]:
    """A figure of bar charts, one row per run of ``indices`` (titled with the run's name when there are
    several runs), each ``slots`` bars of ``slot_in`` inches wide, sharing the value axis."""
    figure = Figure(
        figsize=(max(7.0, slot_in * slots + 3.0), 0.6 + BAR_ROW_IN * len(indices)),
        layout="constrained",
        dpi=DPI,
    )
    axes = list(figure.subplots(len(indices), 1, sharey=True, squeeze=False)[:, 0])
    for ax, index in zip(axes, indices, strict=True):
        ax.set_xlim(-0.6, slots - 0.4)  # the same bar width in every row
        ax.grid(axis="y", alpha=0.3)
        if len(runs) > 1:
            ax.set_title(runs[index].name, fontsize=9, color=run_colors(len(runs))[index], loc="left")
    return figure, axes


def _title_rows(figure: Figure, axes: Sequence[Axes], title: str) -> None:
    """The figure's title: over the one row, or over the runs' rows."""
    if len(axes) == 1 and not axes[0].get_title(loc="left"):
        axes[0].set_title(title)
    else:
        figure.suptitle(title)


def _value_labels(ax: Axes, positions: np.ndarray, values: Sequence[float | None]) -> None:
    """Each bar's value (seconds) just above its top."""
    for position, value in zip(positions, values, strict=True):
        if value is not None:
            ax.annotate(
                f"{value:.1f} s", (position, value), xytext=(0, 2), textcoords="offset points",
                ha="center", va="bottom", fontsize=7,
            )  # fmt: skip


def _switch_cost_figure(runs: Sequence[RunData]) -> Figure | None:
    rows = [(index, switch_costs(run)) for index, run in enumerate(runs)]
    rows = [(index, costs) for index, costs in rows if costs]
    if not rows:
        return None
    charged = {index: charged_switch_costs(runs[index], stage_summaries(runs[index])) for index, _ in rows}
    any_charged = any(cost.into_stage in charged[index] for index, costs in rows for cost in costs)
    width = 0.38 if any_charged else 0.6
    offset = width / 2 if any_charged else 0.0
    figure, axes = _bar_rows(runs, [index for index, _ in rows], max(len(costs) for _, costs in rows), 1.1)
    tallest = 0.0
    for ax, (index, costs) in zip(axes, rows, strict=True):
        positions = np.arange(len(costs))
        totals = np.zeros(len(costs))
        for part_index, part in enumerate(SWITCH_PARTS):
            heights = np.array([cost.parts.get(part, 0.0) for cost in costs])
            if heights.any():
                ax.bar(
                    positions - offset,
                    heights,
                    width,
                    bottom=totals,
                    color=f"C{part_index}",
                    label=PART_NAMES[part],
                )
                totals += heights
        _value_labels(ax, positions - offset, list(totals))
        values = [charged[index].get(cost.into_stage) for cost in costs]
        for position, value in zip(positions, values, strict=True):
            if value is not None:
                ax.bar(position + offset, value, width, color="white", edgecolor="black", hatch="//")
        _value_labels(ax, positions + offset, values)
        ax.set_xticks(
            positions, [f"stage {cost.into_stage - 1}\u2192{cost.into_stage}" for cost in costs], fontsize=8
        )
        ax.set_ylabel("seconds")
        tallest = max(tallest, totals.max(), *(value or 0.0 for value in values))
    axes[0].set_ylim(0, tallest * 1.15)  # room for the values over the tallest bar
    _title_rows(
        figure,
        axes,
        "Switch cost by part (measured)" + (", and the cost the policy charged" if any_charged else ""),
    )
    handles, names = _switch_cost_legend(axes, any_charged)
    legend_beside(axes[0], handles, names, fontsize=8)
    return figure


def _switch_cost_legend(axes: Sequence[Axes], charged: bool) -> tuple[list, list[str]]:
    """The parts as stacked (the last part first), each once, then the charged bar."""
    parts: dict[str, object] = {}
    for ax in axes:
        for handle, name in zip(*ax.get_legend_handles_labels(), strict=True):
            parts.setdefault(name, handle)
    order = [PART_NAMES[part] for part in reversed(SWITCH_PARTS) if PART_NAMES[part] in parts]
    handles, names = [parts[name] for name in order], order
    if charged:
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="//"))
        names.append("cost the policy charged\n(decisions.jsonl)")
    return handles, names
