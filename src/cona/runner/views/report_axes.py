"""Axis helpers of the report figures (:mod:`cona.runner.views.report_figures`): log axes whose ticks can
be read at every value plotted, switch labels that do not overlap, legends beside the axes, not on a line."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.legend import Legend
from matplotlib.ticker import EngFormatter, LogLocator, NullFormatter

LOG_TICK_SUBS = (1.0, 1.5, 2.0, 3.0, 5.0, 7.0)
"""Labelled ticks of a log axis spanning less than :data:`FEW_DECADES`: each value lies within a factor
1.67 of a labelled tick (1k, 1.5k, 2k, 3k, 5k, 7k, 10k), so a run's last value can be read off the axis."""
FINE_LOG_TICK_SUBS = (1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0)
"""Labelled ticks of a log axis spanning less than a factor 3, where :data:`LOG_TICK_SUBS` leaves two."""
FEW_DECADES = 100.0
WIDE_LOG_TICK_SUBS = (1.0, 2.0, 5.0)
"""Labelled ticks of a log axis spanning less than :data:`MANY_DECADES`: within a factor 2.5 of any value."""
MANY_DECADES = 1e4
_SUBS_BY_SPAN = ((3.0, FINE_LOG_TICK_SUBS), (FEW_DECADES, LOG_TICK_SUBS), (MANY_DECADES, WIDE_LOG_TICK_SUBS))
SWITCH_LABEL_FONTSIZE = 7.0
LABEL_GAP = 1.4
"""Least distance between two switch labels' anchors, in multiples of their font size (the labels are
rotated, so this is their width plus a small gap)."""


def label_log_axis(ax: Axes) -> None:
    """Plain numbers (1.5k, not 10^3.2) on a log y axis, dense enough to read any plotted value: the ticks
    of :data:`FINE_LOG_TICK_SUBS` under a factor 3, of :data:`LOG_TICK_SUBS` under two decades, of
    :data:`WIDE_LOG_TICK_SUBS` under four, else the decades."""
    low, high = ax.get_ylim()
    span = high / low if low > 0 else float("inf")
    if span < MANY_DECADES:
        subs = next(subs for limit, subs in _SUBS_BY_SPAN if span < limit)
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=subs, numticks=50))
        ax.yaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_formatter(EngFormatter(sep=""))


@dataclass(frozen=True)
class SwitchLabel:
    """One switch's label, drawn at the top of ``ax`` beside the dashed line at data ``x``."""

    ax: Axes
    x: float
    text: str
    color: str


def draw_switch_labels(figure: Figure, labels: Sequence[SwitchLabel]) -> list:
    """Draw the labels (rotated, at the top of their axes), moving each one right of its line just as far
    as it takes not to overlap its left neighbour (they stay in the order of their lines). Called once
    everything else is plotted, so that the axes' limits and layout are final. Returns the texts."""
    if not labels:
        return []
    figure.draw_without_rendering()  # the layout, so data positions become final pixel positions
    gap_px = LABEL_GAP * SWITCH_LABEL_FONTSIZE * figure.dpi / 72.0
    texts = []
    by_axes: dict[int, list[SwitchLabel]] = {}
    for label in labels:
        by_axes.setdefault(id(label.ax), []).append(label)
    for group in by_axes.values():
        placed_px = float("-inf")
        for label in sorted(group, key=lambda item: item.x):
            line_px = float(label.ax.transData.transform((label.x, 0.0))[0])
            placed_px = max(line_px + 3.0, placed_px + gap_px)
            shift_pt = (placed_px - line_px) * 72.0 / figure.dpi
            text = label.ax.annotate(
                label.text,
                xy=(label.x, 1.0),
                xycoords=("data", "axes fraction"),
                xytext=(shift_pt, -4),
                textcoords="offset points",
                rotation=90,
                va="top",
                ha="left",
                fontsize=SWITCH_LABEL_FONTSIZE,
                color=label.color,
            )
            text.set_in_layout(False)  # placed for the final layout: it must not change it
            texts.append(text)
    return texts


def legend_beside(ax: Axes, handles: list, **options) -> Legend:
    """The legend right of the axes (constrained layout makes room), where it cannot cover a line."""
    return ax.legend(
        handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, **options
    )
