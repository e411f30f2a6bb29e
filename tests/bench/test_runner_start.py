"""bench/runner_start.py: its configs and commands, the plan time it reads, and its summary lines."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def runner_start(import_bench):
    return import_bench("runner_start")


def test_each_mode_gets_a_config_and_the_fixed_one_a_one_stage_chain(runner_start, tmp_path) -> None:
    runner_start.prepare(tmp_path, tmp_path / "data", "cpu")
    for mode in runner_start.MODES:
        config = json.loads((tmp_path / mode / ".conaconfig").read_text())
        assert config["training"]["log_root"] == str(tmp_path / mode / "logs")
        assert config["training"]["data_prefix"] == str(tmp_path / "data" / "bench_text_document")
    (step,) = json.loads((tmp_path / "fixed" / "chain.json").read_text())["steps"]
    assert step["train_iters"] == runner_start.ITERATIONS and step["is_initial"]
    fixed = runner_start.command("fixed", tmp_path / "fixed", "cpu_gloo")
    online = runner_start.command("online", tmp_path / "online", "cpu_gloo")
    assert "--chain" in fixed and "--system" not in fixed
    assert online[online.index("--system") + 1] == "cpu_gloo" and "--chain" not in online


def test_the_start_is_read_at_the_first_stages_plan_and_summed_up_against_the_import(
    runner_start, tmp_path
) -> None:
    (tmp_path / "runner_state.json").write_text(json.dumps({"stages": [{"planned_at": 1002.5}]}))
    assert runner_start.planned_after(tmp_path, 1000.0) == pytest.approx(2.5)
    rounds = [
        {"import torch": 2.0, "fixed": 1.0},
        {"import torch": 2.0, "fixed": 3.0},
        {"import torch": 2.0, "fixed": 2.0},
    ]
    lines = runner_start.summary(rounds)
    assert lines[1].strip().startswith("fixed: median   2.00 s (min 1.00, max 3.00; 1.00x")
