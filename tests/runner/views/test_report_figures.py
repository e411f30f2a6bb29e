"""The report's figures as a reader sees them, on a seven-stage run shaped like ``cona demo``'s and on three
such runs overlaid (:mod:`tests.helpers.demo_like_run`): no text covers another (the extents matplotlib
draws them at), switch tags stand above the curves, band labels inside their bands, each switch cost's value
on its own bar, log axes that end at labelled ticks, and one wall time per stage on the console and the page.
"""

from __future__ import annotations

import html
import itertools
from pathlib import Path

import pytest
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.text import Annotation, Text
from matplotlib.transforms import Bbox
from tests.helpers.demo_like_run import STAGES, write_demo_like_run

from cona.engine.spec import StageResult
from cona.runner.state import load_state
from cona.runner.views.online_report import STAGE_COLUMNS_CAPTION, stage_rows
from cona.runner.views.report import load_run, stage_summaries
from cona.runner.views.report_axes import final_layout
from cona.runner.views.report_build import build_report, distinct_names
from cona.runner.views.report_figures import FIGURE_NAMES, draw_figures

STAMPS = ("20261207-061722", "20261207-061838", "20261207-062012")


@pytest.fixture(scope="module")
def run_dirs(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("demo_like")
    return [
        write_demo_like_run(root / stamp / "logs" / "online", seed=index, start=1.8e9 + 1000 * index)
        for index, stamp in enumerate(STAMPS)
    ]


@pytest.fixture(scope="module", params=[1, 3], ids=["one run", "three runs"])
def figures(request, run_dirs) -> dict[str, Figure]:
    runs = distinct_names([load_run(run_dir) for run_dir in run_dirs[: request.param]])
    drawn = draw_figures(runs)
    assert set(drawn) == set(FIGURE_NAMES)
    for figure in drawn.values():
        final_layout(figure)
    return drawn


def text_box(text: Text, renderer) -> Bbox:
    """The box of a text's characters (an annotation's own extent includes its leader line)."""
    if isinstance(text, Annotation):
        text.get_window_extent(renderer)  # places it
    return Text.get_window_extent(text, renderer)


def drawn_texts(figure: Figure) -> list[Text]:
    """Every text the figure shows: titles, axis labels, the tick labels inside the axes' span, texts and
    annotations in the axes, the legends' entries, the figure's title."""
    texts: list[Text] = [*figure.texts]  # the figure's title among them
    for legend in figure.legends:
        texts += legend.get_texts()
    for ax in figure.axes:
        texts += [ax.title, ax._left_title, ax._right_title, ax.xaxis.label, ax.yaxis.label, *ax.texts]
        low_x, high_x, low_y, high_y = ax.bbox.x0 - 1, ax.bbox.x1 + 1, ax.bbox.y0 - 1, ax.bbox.y1 + 1
        for label in ax.get_xticklabels():
            x = ax.transData.transform((label.get_position()[0], 0))[0]
            texts += [label] if low_x <= x <= high_x else []
        for label in ax.get_yticklabels():
            y = ax.transData.transform((0, label.get_position()[1]))[1]
            texts += [label] if low_y <= y <= high_y else []
        if ax.get_legend() is not None:
            texts += ax.get_legend().get_texts()
    return [text for text in texts if text.get_visible() and text.get_text().strip()]  # each once


def test_no_text_of_any_figure_overlaps_another(figures):
    for name, figure in figures.items():
        renderer = final_layout(figure)
        boxes = [(text.get_text(), text_box(text, renderer)) for text in drawn_texts(figure)]
        for (first, a), (second, b) in itertools.combinations(boxes, 2):
            overlap = min(a.x1, b.x1) - max(a.x0, b.x0), min(a.y1, b.y1) - max(a.y0, b.y0)
            assert min(overlap) <= 0.5, f"{name}: {first!r} {a} and {second!r} {b} overlap"
        for text, box in boxes:
            assert figure.bbox.x0 - 0.5 <= box.x0 and box.x1 <= figure.bbox.x1 + 0.5, f"{name}: {text!r} cut"


def test_switch_tags_stand_above_the_curves_one_per_switch(figures):
    for name in ("loss_vs_tokens", "loss_vs_time"):
        top = figures[name].axes[0]
        renderer = final_layout(figures[name])
        tags = [text for text in top.texts if isinstance(text, Annotation)]
        runs = len(figures[name].legends[0].get_lines()) - 1  # less the switch line's entry
        assert len(tags) == runs * (len(STAGES) - 1)
        assert all(text_box(tag, renderer).y0 >= top.bbox.y1 for tag in tags), name
        assert sorted({tag.get_text() for tag in tags}, key=int) == [
            str(n) for n in range(2, len(STAGES) + 1)
        ]


def test_band_labels_lie_inside_their_bands(figures):
    band_ax = figures["strategy_timeline"].axes[1]
    renderer = final_layout(figures["strategy_timeline"])
    bands = [patch.get_window_extent(renderer) for patch in band_ax.patches if isinstance(patch, Rectangle)]
    for text in band_ax.texts:
        box = text_box(text, renderer)
        assert any(
            band.x0 <= box.x0 and box.x1 <= band.x1 and band.y0 <= box.y0 and box.y1 <= band.y1
            for band in bands
        ), text.get_text()
    labelled = {text.get_text().split(":")[0] for text in band_ax.texts}
    assert "1" in labelled  # the widest band (the first stage's start-up) has room


def test_each_switch_cost_is_written_on_top_of_its_own_bar(figures):
    for ax in figures["switch_costs"].axes:
        bars = [patch for patch in ax.patches if isinstance(patch, Rectangle) and patch.get_height() > 0]
        tops = {}
        for bar in bars:  # the stacked parts of a switch end at its total
            key = round(bar.get_x() + bar.get_width() / 2, 6)
            tops[key] = max(tops.get(key, 0.0), bar.get_y() + bar.get_height())
        values = [text for text in ax.texts if text.get_text().endswith(" s")]
        assert len(values) == len(tops) > 0
        for text in values:
            x, y = text.xy
            assert tops[round(x, 6)] == pytest.approx(y), text.get_text()
            assert text.get_text() == f"{y:.1f} s"


def test_the_perplexity_axis_ends_at_labelled_ticks_and_has_no_unlabelled_one(figures):
    ax = figures["loss_vs_tokens"].axes[1]
    low, high = ax.get_ylim()
    formatter = ax.yaxis.get_major_formatter()
    labelled = {value for value in ax.yaxis.get_majorticklocs() if formatter(value)}
    assert any(value == pytest.approx(low) for value in labelled)
    assert any(value == pytest.approx(high) for value in labelled)
    assert len(ax.yaxis.get_minorticklocs()) == 0


def test_the_console_and_the_page_give_a_stage_the_same_wall_time_and_rate(run_dirs, tmp_path):
    run_dir = run_dirs[0]
    state = load_state(run_dir)
    stages = [
        {"strategy": dict(zip(("dp", "tp", "pp", "mbs", "gbs"), stage[:5], strict=True)), "action": stage[6]}
        for stage in STAGES
    ]
    console = stage_rows(run_dir, state, stages)
    report = stage_summaries(load_run(run_dir))
    for row, summary in zip(console, report, strict=True):
        launched_to_saved = StageResult.read(
            run_dir / "stages" / str(summary.stage) / "stage_result.json"
        ).wall_s
        assert row["wall_s"] == summary.wall_s == launched_to_saved
        assert row["tokens_per_s"] == summary.tokens_per_s
    assert report[0].wall_s > report[0].end_time - report[0].start_time  # the start-up counts
    spans = [(summary.first_iteration, summary.last_iteration) for summary in report]
    assert spans[0][0] == 1 and all(
        now[0] == before[1] + 1 for before, now in zip(spans, spans[1:], strict=False)
    )
    page = build_report([run_dir], tmp_path / "report").html.read_text()
    assert f"<td>{report[0].wall_s:.4g}</td>" in page
    assert html.escape(STAGE_COLUMNS_CAPTION) in page
