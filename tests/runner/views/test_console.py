"""The live console driven from a recorded run: the tailer, the mode choice, plain/quiet/rich output of a
stage whose metrics arrive as the workers would append them, and the launcher wrapper."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import pytest
from rich.console import Console
from tests.helpers.paths import RUN_CHAIN_SMALL

from cona.engine.spec import StageSpec
from cona.errors import ConfigError
from cona.jsonl import JsonlTail
from cona.runner.launch import Topology
from cona.runner.schedules.chain_schedule import StageLaunch
from cona.runner.views.console import RunConsole, StageMonitor, choose_mode, render_stage

FIXTURE = RUN_CHAIN_SMALL
STAGE = 2


def fixture_lines(name: str) -> list[str]:
    return (FIXTURE / name).read_text().splitlines()


def stage_spec(run_dir: Path) -> StageSpec:
    return dataclasses.replace(StageSpec.read(FIXTURE / "stages" / str(STAGE) / "spec.json"), run_dir=run_dir)


def stage_records() -> list[str]:
    return [line for line in fixture_lines("metrics.jsonl") if json.loads(line)["stage"] == STAGE]


def append(path: Path, text: str) -> None:
    with open(path, "a") as handle:
        handle.write(text)


@pytest.fixture
def run_dir(tmp_path) -> Path:
    """A run directory where stage 1 has finished: its metrics are there, stage 2's are to come."""
    path = tmp_path / "run"
    path.mkdir()
    earlier = [line for line in fixture_lines("metrics.jsonl") if json.loads(line)["stage"] < STAGE]
    (path / "metrics.jsonl").write_text("".join(line + "\n" for line in earlier))
    return path


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def replay_stage(console: RunConsole, clock: Clock, run_dir: Path) -> None:
    """Stage 2 as its workers write it: each record in two writes (the console polls between them, when the
    line is half written), decisions beside them, the console polled as run_stage would."""
    decisions = [json.loads(line) for line in fixture_lines("decisions.jsonl")]
    with console.stage(stage_spec(run_dir)) as watch:
        for line in stage_records():
            record = json.loads(line)
            append(run_dir / "metrics.jsonl", line[:20])
            watch()
            append(run_dir / "metrics.jsonl", line[20:] + "\n")
            for decision in decisions:
                if decision["iteration"] == record["iteration"]:
                    append(run_dir / "decisions.jsonl", json.dumps({"stage": STAGE, **decision}) + "\n")
            clock.now = record["time"] + 1.0
            watch()


def test_the_tail_reads_appended_lines_and_waits_for_a_partial_one(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = JsonlTail(path)
    assert tail.new_records() == []  # not written yet
    path.write_text('{"iteration": 1}\n{"iteration": 2')
    assert tail.new_records() == [{"iteration": 1}]
    append(path, '}\nnot json\n[1, 2]\n{"iteration": 3}\n')
    assert tail.new_records() == [{"iteration": 2}, {"iteration": 3}]  # the broken lines are skipped
    assert tail.new_records() == []
    assert JsonlTail.at_end(path).new_records() == []


def test_the_mode_follows_quiet_then_the_environment_then_the_terminal():
    assert choose_mode(quiet=False, is_terminal=True, environ={}) == "rich"
    assert choose_mode(quiet=False, is_terminal=False, environ={}) == "plain"
    assert choose_mode(quiet=False, is_terminal=True, environ={"CONA_CONSOLE": "plain"}) == "plain"
    assert choose_mode(quiet=False, is_terminal=False, environ={"CONA_CONSOLE": "rich"}) == "rich"
    assert choose_mode(quiet=True, is_terminal=True, environ={"CONA_CONSOLE": "rich"}) == "quiet"
    with pytest.raises(ConfigError, match="CONA_CONSOLE='fancy': use one of rich, plain, quiet"):
        choose_mode(quiet=False, is_terminal=True, environ={"CONA_CONSOLE": "fancy"})


def test_plain_mode_writes_one_stable_line_per_log_interval(run_dir):
    out = io.StringIO()
    clock = Clock(json.loads(stage_records()[0])["time"] - 20.0)
    console = RunConsole("plain", Console(file=out, width=80), clock=clock)
    console.message("stage 2: dp4/tp1/pp1 mbs4 gbs16 from iteration 50")
    replay_stage(console, clock, run_dir)

    lines = out.getvalue().splitlines()
    assert "\x1b" not in out.getvalue()  # no cursor control or colour
    assert len(lines) == 1 + len(stage_records()) + 1  # message, one per interval, summary
    assert lines[0] == "stage 2: dp4/tp1/pp1 mbs4 gbs16 from iteration 50"
    assert lines[1] == (
        "stage 2 iter     55 | loss 7.7419 | lr 1.41e-03 | 3.580 s/it | 572 tok/s | gnorm 1.079 | "
        "61,440 tokens | noise scale 23.1 samples | tokens 61.4k in 51.2k->461k (2%) | eta 11:38"
    )
    assert all(line.startswith("stage 2 iter ") for line in lines[1:-1])
    assert "eval 7.6969 ppl 2201.45" in lines[2]
    assert lines[-1] == (
        "stage 2 (dp4 tp1 pp1 mbs4 gbs16) ended after 2:37 at iteration 110: loss 6.6237, "
        "eval ppl 947.30 (it 100), tokens/s 874, noise scale 141 samples"
    )


def test_quiet_mode_prints_only_the_stage_lines(run_dir):
    out = io.StringIO()
    clock = Clock(json.loads(stage_records()[0])["time"] - 20.0)
    console = RunConsole("quiet", Console(file=out, width=80), clock=clock)
    console.message("stage 2: dp4/tp1/pp1 mbs4 gbs16 from iteration 50")
    replay_stage(console, clock, run_dir)

    lines = out.getvalue().splitlines()
    assert lines[0] == "stage 2: dp4/tp1/pp1 mbs4 gbs16 from iteration 50"
    assert len(lines) == 2 and lines[1].startswith("stage 2 (dp4 tp1 pp1 mbs4 gbs16) ended after 2:37")


def test_rich_panel_shows_the_bar_the_strategy_the_metrics_and_the_best_candidate(run_dir):
    monitor = StageMonitor(stage_spec(run_dir), launched_at=0.0)
    lines = stage_records()
    append(run_dir / "metrics.jsonl", "".join(line + "\n" for line in lines[:8]))
    decision = next(
        json.loads(d) for d in fixture_lines("decisions.jsonl") if json.loads(d)["iteration"] == 90
    )
    append(run_dir / "decisions.jsonl", json.dumps({"stage": STAGE, **decision}) + "\n")
    monitor.poll()
    console = Console(record=True, force_terminal=True, width=120)
    console.print(render_stage(monitor.snapshot, now=monitor.snapshot.last["time"]))
    text = console.export_text()

    assert "━" in text and "dp4 tp1 pp1 mbs4 gbs16" in text
    assert "tokens 133k in 51.2k->461k (20%)" in text and "eta 6:36" in text
    assert "loss 6.8797" in text and "eval ppl 1312.64 (it 80)" in text and "tokens/s 827" in text
    assert "MFU -" in text and "noise scale 73.7 samples" in text
    assert "best: dp2 tp2 pp1 mbs8 gbs32, +7.5% goodput (switch at +13.7%)" in text


def test_rich_mode_runs_a_live_panel_and_leaves_the_summary(run_dir):
    out = io.StringIO()
    clock = Clock(json.loads(stage_records()[0])["time"] - 20.0)
    console = RunConsole("rich", Console(file=out, force_terminal=True, width=120), clock=clock)
    replay_stage(console, clock, run_dir)
    console.message("stage 2 -> 3: switch")

    screen = out.getvalue()
    assert "━" in screen and "\x1b[" in screen  # the panel was drawn with cursor control
    assert "stage 2 (dp4 tp1 pp1 mbs4 gbs16) ended after 2:37 at iteration 110" in screen
    assert screen.rstrip().endswith("stage 2 -> 3: switch")


def test_the_launcher_silences_the_workers_and_keeps_the_other_watch(run_dir):
    out = io.StringIO()
    console = RunConsole("plain", Console(file=out), clock=Clock(0.0))
    calls: list[str] = []
    seen: list[StageLaunch] = []

    def base(launch: StageLaunch) -> None:
        seen.append(launch)
        append(run_dir / "metrics.jsonl", stage_records()[0] + "\n")
        launch.watch()

    spec = stage_spec(run_dir)
    launch = StageLaunch(
        spec=spec,
        spec_path=Path("spec.json"),
        topology=Topology(nproc_per_node=1, master_port=29500),
        device_type="cpu",
        watch=lambda: calls.append("x"),
    )
    console.launcher(base)(launch)

    assert seen[0].quiet and calls == ["x"]
    assert out.getvalue().splitlines()[0].startswith("stage 2 iter     55 | loss 7.7419")


def test_a_diverged_interval_reads_nan_and_a_broken_record_stops_only_the_display(run_dir):
    out = io.StringIO()
    console = RunConsole("plain", Console(file=out), clock=Clock(0.0))
    diverged = {**json.loads(stage_records()[0]), "loss": None, "eval_loss": 800.0, "eval_ppl": None}
    with console.stage(stage_spec(run_dir)) as watch:
        append(run_dir / "metrics.jsonl", json.dumps(diverged) + "\n")
        watch()
        append(run_dir / "metrics.jsonl", json.dumps({"stage": STAGE, "iteration": 60}) + "\n")
        watch()  # a record without its numbers: the display of the stage stops, nothing raises
        append(run_dir / "metrics.jsonl", stage_records()[1] + "\n")
        watch()

    lines = out.getvalue().splitlines()
    assert lines[0].startswith("stage 2 iter     55 | loss nan |") and "eval 800.0000 ppl inf" in lines[0]
    assert lines[1].startswith("stage 2: live console stopped (KeyError: ") and lines[1].endswith(
        "training goes on"
    )
    assert len(lines) == 3 and lines[2].startswith("stage 2 (dp4 tp1 pp1 mbs4 gbs16) ended after")
