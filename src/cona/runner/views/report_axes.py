"""Axis helpers of the report figures (:mod:`cona.runner.views.report_figures`): log axes whose ticks can
be read at every value plotted, switch tags above the axes that do not overlap, legends beside the axes, not
on a line."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg, RendererAgg
from matplotlib.figure import Figure
from matplotlib.legend import Legend
from matplotlib.text import Annotation, Text
from matplotlib.ticker import EngFormatter, FuncFormatter, LogLocator, NullLocator

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
TAG_FONTSIZE = 7.5
TAG_ROW_PT = 11.0
"""Height of a row of switch tags above the axes (points): one row per run."""
TAG_RISE_PT = 3.0
"""Gap between the top of the axes and the first row of tags (points): the tag's leader line."""
TAG_GAP_PX = 3.0
"""Least horizontal gap between two tags of a row (pixels)."""


def label_log_axis(ax: Axes) -> None:
    """Plain numbers (1.5k, not 10^3.2) on a log y axis, dense enough to read any plotted value: the ticks
    of :data:`FINE_LOG_TICK_SUBS` under a factor 3, of :data:`LOG_TICK_SUBS` under two decades, of
    :data:`WIDE_LOG_TICK_SUBS` under four, else the decades. Under four decades the axis runs from the
    labelled tick below the lowest value to the one above the highest, and has no unlabelled ticks."""
    low, high = ax.get_ylim()
    span = high / low if low > 0 else float("inf")
    if span < MANY_DECADES:
        subs = next(subs for limit, subs in _SUBS_BY_SPAN if span < limit)
        locator = LogLocator(base=10, subs=subs, numticks=50)
        ax.yaxis.set_major_locator(locator)
        ax.yaxis.set_minor_locator(NullLocator())  # a tick is a labelled one: none the reader cannot read
        ticks = locator.tick_values(low, high)
        below, above = ticks[ticks <= low * (1 + 1e-9)], ticks[ticks >= high * (1 - 1e-9)]
        if len(below) and len(above):  # the axis from a labelled tick to a labelled tick
            ax.set_ylim(below.max(), above.min())
    ax.yaxis.set_major_formatter(FuncFormatter(plain_number))


def plain_number(value: float, position: int | None = None) -> str:
    """A tick's value as a reader writes it: 1.5k and 2M above a thousand, 0.7 (not 700m) below one."""
    return EngFormatter(sep="")(value, position) if abs(value) >= 1000 else f"{value:g}"


@dataclass(frozen=True)
class SwitchTag:
    """The number of the stage a switch led into, above ``ax`` over the dashed line at data ``x``; tags of
    one ``row`` (a run) never overlap one another."""

    ax: Axes
    x: float
    text: str
    color: str
    row: int = 0


def tag_room_pt(rows: int) -> float:
    """Points above the axes that ``rows`` rows of tags take (the title's pad)."""
    return TAG_RISE_PT + rows * TAG_ROW_PT + 2.0 if rows else 6.0


def draw_switch_tags(figure: Figure, tags: Sequence[SwitchTag]) -> list[Annotation]:
    """Draw the tags above their axes, out of the plotted data, each on a short leader line from the top of
    its dashed line; a row's tags are spread just as far as it takes for them not to overlap
    (:func:`spread`). Called once everything else is plotted, so that the axes' limits and layout are
    final (their titles need :func:`tag_room_pt` of pad). Returns the tags' annotations."""
    if not tags:
        return []
    renderer = final_layout(figure)
    rows: dict[tuple[int, int], list[SwitchTag]] = {}
    for tag in tags:
        rows.setdefault((id(tag.ax), tag.row), []).append(tag)
    drawn = []
    for group in rows.values():
        group = sorted(group, key=lambda tag: tag.x)
        ax = group[0].ax
        texts = [_tag_text(tag) for tag in group]
        lines_px = [float(ax.transData.transform((tag.x, 0.0))[0]) for tag in group]
        widths = [Text.get_window_extent(text, renderer).width for text in texts]
        placed = spread(lines_px, widths, TAG_GAP_PX, ax.bbox.x0, ax.bbox.x1)
        for text, line_px, centre in zip(texts, lines_px, placed, strict=True):
            text.xyann = ((centre - line_px) * 72.0 / figure.dpi, text.xyann[1])
        drawn += texts
    return drawn


def final_layout(figure: Figure) -> RendererAgg:
    """Lay the figure out (data positions become their final pixels) and return the renderer that measures
    its texts (Agg's, which writes the PNG)."""
    if not isinstance(figure.canvas, FigureCanvasAgg):
        FigureCanvasAgg(figure)
    figure.draw_without_rendering()
    return figure.canvas.get_renderer()


def _tag_text(tag: SwitchTag) -> Annotation:
    text = tag.ax.annotate(
        tag.text,
        xy=(tag.x, 1.0),
        xycoords=("data", "axes fraction"),
        xytext=(0.0, TAG_RISE_PT + tag.row * TAG_ROW_PT),
        textcoords="offset points",
        ha="center",
        va="bottom",
        fontsize=TAG_FONTSIZE,
        color=tag.color,
        annotation_clip=False,
        arrowprops={"arrowstyle": "-", "color": tag.color, "linewidth": 0.6, "shrinkA": 0, "shrinkB": 0},
    )
    text.set_in_layout(False)  # placed for the final layout: it must not change it
    return text


def separate_vertically(figure: Figure, texts: Sequence[Annotation]) -> None:
    """Move annotations (written beside their points) up or down just as far as it takes for none to
    overlap another, keeping their order by height (two runs that end at one value keep both labels)."""
    if len(texts) < 2:
        return
    renderer = final_layout(figure)
    boxes = [Text.get_window_extent(text, renderer) for text in texts]
    order = sorted(range(len(texts)), key=lambda index: boxes[index].y0)
    centres = [(boxes[index].y0 + boxes[index].y1) / 2 for index in order]
    heights = [boxes[index].height for index in order]
    placed = spread(centres, heights, 1.0, float("-inf"), float("inf"))
    for index, centre, moved in zip(order, centres, placed, strict=True):
        dx, dy = texts[index].xyann
        texts[index].xyann = (dx, dy + (moved - centre) * 72.0 / figure.dpi)


def spread(
    centres: Sequence[float], widths: Sequence[float], gap: float, low: float, high: float
) -> list[float]:
    """Centres for boxes of ``widths`` (in order, each wanting its centre at ``centres``) with at least
    ``gap`` between neighbours, within ``low``..``high`` where they fit: each moved right only as far as its
    left neighbour requires, then left only as far as its right neighbour or ``high`` requires."""
    placed = list(centres)
    for index in range(len(placed)):
        least = low + widths[index] / 2
        if index:
            least = placed[index - 1] + (widths[index - 1] + widths[index]) / 2 + gap
        placed[index] = max(placed[index], least)
    for index in reversed(range(len(placed))):
        most = high - widths[index] / 2
        if index < len(placed) - 1:
            most = placed[index + 1] - (widths[index] + widths[index + 1]) / 2 - gap
        placed[index] = min(placed[index], most)
    return placed


def legend_beside(ax: Axes, handles: list, labels: list[str] | None = None, **options) -> Legend:
    """The legend in the figure's right margin, level with the top of ``ax`` (the figure's top axes), where
    it cannot cover a line; constrained layout makes room for it beside every row without making any row
    as tall as the legend. ``labels`` name the handles where they carry no label of their own."""
    if labels is not None:
        options["labels"] = labels
    return ax.figure.legend(handles=handles, loc="outside right upper", **options)
