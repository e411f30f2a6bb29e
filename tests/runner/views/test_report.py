"""``cona report`` on the recorded run directory ``fixtures/run_chain_small`` (make_run_chain_small.py)."""

from __future__ import annotations

import base64
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread
from tests.helpers.paths import RUN_CHAIN_SMALL

from cona.cli import main
from cona.errors import ConaError
from cona.jsonl import read_json_lines
from cona.planner.efficiency import MIN_SAMPLES
from cona.runner.views.report import (
    load_run,
    noise_series,
    predicted_throughput,
    stage_summaries,
    switch_costs,
)
from cona.runner.views.report_build import build_report, distinct_names
from cona.runner.views.report_figures import FIGURE_NAMES

FIXTURE = RUN_CHAIN_SMALL
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def copy_fixture(tmp_path: Path, name: str = "run_chain_small") -> Path:
    return Path(shutil.copytree(FIXTURE, tmp_path / name))


def assert_valid_figures(paths: list[Path]) -> None:
    for path in paths:
        assert path.read_bytes()[:8] == PNG_SIGNATURE, path
        pixels = imread(path)
        assert pixels.ndim == 3 and pixels.shape[0] > 200 and pixels.shape[1] > 300, path
        assert float(np.std(pixels[..., :3])) > 0.05, f"{path} is blank"


def assert_html_embeds(html: Path, figures: list[Path]) -> None:
    page = html.read_text()
    for figure in figures:
        assert f"href='{figure.name}'" in page
        assert base64.b64encode(figure.read_bytes()).decode() in page, f"{figure.name} is not embedded"


def test_report_from_the_recorded_run(tmp_path):
    result = build_report([FIXTURE], tmp_path / "out", warn=pytest.fail)

    assert [path.name for path in result.figures] == [f"{name}.png" for name in FIGURE_NAMES]
    assert all(path.parent == tmp_path / "out" for path in result.figures)
    assert_valid_figures(list(result.figures))
    assert_html_embeds(result.html, list(result.figures))
    page = result.html.read_text()
    assert "dp4 tp1 pp1 mbs4 gbs16" in page  # the stage table
    assert page.count("<td class='text'>switch</td>") == 2  # the decisions table: two switches
    assert "stage 1 \u2192 2" in page and "stage 2 \u2192 3" in page  # the switch-cost table
    assert result.warnings == ()


def test_damaged_metrics_of_a_running_run_give_a_report_and_warnings(tmp_path):
    run_dir = copy_fixture(tmp_path)
    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    lines[4] = lines[4][:30] + "#garbage"
    lines[6] = "[1, 2, 3]"
    record = json.loads(lines[8])
    del record["loss"]
    lines[8] = json.dumps(record)
    lines[-1] = lines[-1][:-60]  # the writer is in the middle of the last line
    metrics.write_text("\n".join(lines))
    (run_dir / "stages" / "3" / "stage_result.json").unlink()  # stage 3 is still running
    warnings: list[str] = []

    result = build_report([run_dir], tmp_path / "out", warn=warnings.append)

    assert [re.search(r"line (\d+)", warning).group(1) for warning in warnings] == ["5", "7", "9", "36"]
    assert all(warning.startswith(f"warning: {metrics}: line ") for warning in warnings)
    assert "not valid JSON" in warnings[0] and "not an object" in warnings[1]
    assert "no number for loss" in warnings[2] and "truncated last line" in warnings[3]
    assert len(result.figures) == len(FIGURE_NAMES)
    assert_valid_figures(list(result.figures))
    assert_html_embeds(result.html, list(result.figures))
    assert "truncated last line" in result.html.read_text()
    run = load_run(run_dir)
    assert len(run.metrics) == len(lines) - 4
    assert stage_summaries(run)[-1].reason is None and run.metrics[-1]["iteration"] == 175


def test_two_runs_are_overlaid(tmp_path):
    fixed = make_fixed_run(tmp_path / "fixed_gbs8")
    result = build_report([FIXTURE, fixed], tmp_path / "out", warn=pytest.fail)

    assert len(result.figures) == len(FIGURE_NAMES)
    assert_valid_figures(list(result.figures))
    assert_html_embeds(result.html, list(result.figures))
    page = result.html.read_text()
    assert "<td class='text'>fixed_gbs8</td>" in page and "<td class='text'>run_chain_small</td>" in page
    assert "No decisions recorded" in page  # the fixed run's section of the decisions table


def test_runs_of_the_same_name_are_told_apart(tmp_path):
    runs = [load_run(copy_fixture(tmp_path / parent)) for parent in ("online", "fixed")]
    assert [run.name for run in distinct_names(runs)] == ["online/run_chain_small", "fixed/run_chain_small"]
    assert [run.name for run in distinct_names(runs[:1])] == ["run_chain_small"]
    demos = [load_run(copy_fixture(tmp_path / stamp / "logs")) for stamp in ("061722", "061838")]
    assert [run.name for run in distinct_names(demos)] == ["061722/run_chain_small", "061838/run_chain_small"]


def make_fixed_run(run_dir: Path) -> Path:
    """A one-stage run at gbs 8 (stage 1 of the fixture), with no run state and no decisions."""
    (run_dir / "stages" / "1").mkdir(parents=True)
    shutil.copy(FIXTURE / "stages" / "1" / "spec.json", run_dir / "stages" / "1" / "spec.json")
    stage_one = [
        line for line in (FIXTURE / "metrics.jsonl").read_text().splitlines() if '"stage": 1' in line
    ]
    (run_dir / "metrics.jsonl").write_text("\n".join(stage_one) + "\n")
    return run_dir


def test_switch_costs_fall_back_to_the_stage_results(tmp_path):
    run_dir = copy_fixture(tmp_path)
    from_state = switch_costs(load_run(run_dir))
    (run_dir / "runner_state.json").unlink()
    from_results = switch_costs(load_run(run_dir))

    assert [cost.into_stage for cost in from_state] == [2, 3]
    assert from_state[0].parts == pytest.approx(
        {"save_s": 1.3, "publish_s": 0.04, "process_start_s": 26.1, "load_s": 12.6, "first_step_s": 5.5}
    )
    assert [cost.source for cost in from_results] == ["stage_result.json"] * 2
    # The workers' own timings: the same save, load and first step; no process start or publish.
    assert from_results[1].parts == pytest.approx({"save_s": 3.4, "load_s": 9.7, "first_step_s": 7.9})


def test_noise_scale_efficiency_and_predictions_from_the_fixture():
    run = load_run(FIXTURE)
    points = noise_series(run)

    # from the tracker's first estimate, at its MIN_SAMPLES-th measurement
    assert points[0].tokens == run.metrics[MIN_SAMPLES - 1]["consumed_tokens"]
    for point in points:
        assert point.efficiency == pytest.approx((point.noise_scale + 8) / (point.noise_scale + point.gbs))
    assert 2 < points[0].noise_scale < 20 < 200 < points[-1].noise_scale < 1000  # grows as the loss falls
    assert predicted_throughput(run, stage_summaries(run)) == {1: 530.0, 2: 860.0, 3: 1200.0}


def test_read_json_lines_reports_each_bad_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"a": 1}\n\n{"a": \n"text"\n{"b": 2}\n{"a": 3')

    read = read_json_lines(path, required=("a",))

    assert read.records == ({"a": 1},)
    assert [warning.split(": ", 2)[1] for warning in read.warnings] == [
        "line 3",
        "line 4",
        "line 5",
        "line 6",
    ]
    assert "truncated last line" in read.warnings[-1]
    assert read_json_lines(tmp_path / "missing.jsonl").records == ()


def test_cli_report_writes_into_the_run_directory_by_default(tmp_path, capsys):
    run_dir = copy_fixture(tmp_path)
    assert main(["report", str(run_dir)]) == 0
    assert f"report: {run_dir / 'report' / 'index.html'}" in capsys.readouterr().out
    assert (run_dir / "report" / "index.html").is_file()

    assert main(["report", str(tmp_path / "nowhere")]) == 1
    assert f"cona: error: run directory {tmp_path / 'nowhere'} does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConaError, match="not a run directory"):
        load_run(tmp_path / "empty")
