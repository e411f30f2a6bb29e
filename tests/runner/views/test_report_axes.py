"""The report figures' axes: log ticks that reach the plotted values, switch labels apart, legends aside."""

from __future__ import annotations

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.text import Text
from tests.helpers.paths import RUN_CHAIN_SMALL as FIXTURE

from cona.runner.views.report import load_run, stage_summaries
from cona.runner.views.report_axes import SwitchTag, draw_switch_tags, label_log_axis, legend_beside, spread
from cona.runner.views.report_figures import _loss_figure


def labelled_ticks(ax) -> dict[float, str]:
    """The y ticks inside the axis limits with the text each is labelled with (empty: none)."""
    ax.figure.draw_without_rendering()
    low, high = ax.get_ylim()
    formatter = ax.yaxis.get_major_formatter()
    locations = [value for value in ax.yaxis.get_majorticklocs() if low <= value <= high]
    return {value: formatter(value) for value in locations if formatter(value)}


def text_box(annotation, renderer):
    """An annotation's own text box (its window extent includes its leader line)."""
    annotation.get_window_extent(renderer)  # places it
    return Text.get_window_extent(annotation)


def log_axes(values) -> object:
    ax = Figure().subplots()
    ax.plot(np.arange(len(values)), values)
    ax.set_yscale("log")
    label_log_axis(ax)
    return ax


def test_a_log_axis_has_a_labelled_tick_near_every_value():
    cases = (  # values, and the factor within which each has a labelled tick
        ([4500, 2500, 1200, 700, 380], 1.7),  # the final value (the smallest) included
        ([900, 700, 520, 410], 1.3),
        ([40_000, 9_000, 800, 60], 2.5),
    )
    for values, factor in cases:
        ticks = labelled_ticks(log_axes(values))
        assert len(ticks) >= 4, ticks
        for value in values:
            assert min(abs(np.log(value / tick)) for tick in ticks) <= np.log(factor), (value, ticks)


def test_a_log_axis_shows_plain_numbers():
    ticks = labelled_ticks(log_axes([4500, 2500, 1200, 700, 380]))
    assert {"500", "1k", "1.5k", "2k", "3k"} <= set(ticks.values())
    assert {"0.7", "1", "2"} <= set(labelled_ticks(log_axes([0.9, 1.5, 30])).values())  # not 700m


def test_spread_moves_boxes_only_as_far_as_their_neighbours_need():
    # three 10-wide boxes wanting one centre, one far away: the three side by side, the far one in place
    assert spread([50, 50, 50, 200], [10, 10, 10, 10], 2, 0, 300) == [50, 62, 74, 200]
    assert spread([295, 296], [10, 10], 2, 0, 300) == [283, 295]  # pushed back inside the right end
    assert spread([1], [10], 2, 0, 300) == [5]  # and inside the left end


def test_close_switch_tags_are_moved_apart_above_the_axes_and_far_ones_stay_at_their_line():
    figure = Figure(figsize=(9, 4))
    FigureCanvasAgg(figure)
    ax = figure.subplots()
    ax.plot([0, 100], [0, 1])
    xs = [20.0, 20.3, 20.6, 70.0]
    texts = draw_switch_tags(figure, [SwitchTag(ax, x, str(i + 2), "C0") for i, x in enumerate(xs)])
    renderer = figure.canvas.get_renderer()
    boxes = sorted((text_box(text, renderer) for text in texts), key=lambda box: box.x0)
    for left, right in zip(boxes, boxes[1:], strict=False):
        assert left.x1 <= right.x0, "two switch tags overlap"
    assert all(box.y0 >= ax.bbox.y1 for box in boxes), "a tag is on the plotted data"
    far_line = ax.transData.transform((70.0, 0.0))[0]
    assert abs((boxes[-1].x0 + boxes[-1].x1) / 2 - far_line) < 0.5  # a tag with room stays over its line


def test_the_legend_is_beside_the_axes_not_on_them():
    figure = Figure(figsize=(9, 4), layout="constrained")
    FigureCanvasAgg(figure)
    ax = figure.subplots()
    lines = [ax.plot(np.arange(10), np.arange(10) * k, label=f"run {k}")[0] for k in range(3)]
    legend = legend_beside(ax, lines, fontsize=8)
    figure.draw_without_rendering()
    renderer = figure.canvas.get_renderer()
    assert legend.get_window_extent(renderer).x0 >= ax.get_window_extent(renderer).x1
    assert legend.get_window_extent(renderer).x1 <= figure.bbox.x1  # and inside the figure


def test_the_loss_figure_of_two_runs_keeps_its_legend_off_the_lines():
    runs = [load_run(FIXTURE), load_run(FIXTURE)]
    figure = _loss_figure(runs, [stage_summaries(run) for run in runs], axis="tokens", unit="s", divisor=1.0)
    FigureCanvasAgg(figure)
    figure.draw_without_rendering()
    renderer = figure.canvas.get_renderer()
    top = figure.axes[0]
    assert figure.legends[0].get_window_extent(renderer).x0 >= top.get_window_extent(renderer).x1
    assert "373.1" in [text.get_text() for text in figure.axes[1].texts]  # the final perplexity, written out
