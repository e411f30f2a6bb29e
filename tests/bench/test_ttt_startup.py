"""bench/ttt_startup.py: a run's start-up split at its first stage's plan, on planted run files."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def startup_module(import_bench):
    return import_bench("ttt_startup")


def test_the_start_up_splits_at_the_first_stages_plan(startup_module, tmp_path, capsys) -> None:
    run_dir = tmp_path / "work" / "online" / "logs" / "online"
    run_dir.mkdir(parents=True)
    # launched at 1000.0, planned at 1008.5; the first line at 1025.0 after 8 steps of 0.5 s: first step 1021
    (run_dir / "runner_state.json").write_text(json.dumps({"stages": [{"planned_at": 1008.5}]}))
    line = {"time": 1025.0, "step_time_s": 0.5, "steps_in_interval": 8, "gbs": 8}
    (run_dir / "metrics.jsonl").write_text(json.dumps(line) + "\n")
    row = {"run": "online", "startup_s": 21.0}
    assert startup_module.startup_split(row, run_dir) == {
        "startup_s": 21.0,
        "runner_s": 8.5,
        "workers_s": 12.5,
    }
    report = tmp_path / "ttt.json"
    report.write_text(json.dumps({"runs": [row, {"run": "fixed-gbs32", "startup_s": 20.0}]}))
    startup_module.main(["--json", str(report), "--work-dir", str(tmp_path / "work")])
    out = capsys.readouterr().out
    assert "online: start-up 21.0 s = runner 8.50 s + workers 12.50 s" in out
    assert "fixed-gbs32: no run files" in out
