"""``cona plan --curves``: the table from a SYNTHETIC curves file (tests/helpers/synthetic_curves.py)."""

from __future__ import annotations

import json

import pytest
from tests.helpers.synthetic_curves import MODEL, write_synthetic_curves

from cona.cli import main
from cona.config import ConaConfig, ModelConfig, TrainingConfig
from cona.runner.chain_file import load_chain

ARGS = ["plan", "--system", "h100_80g", "--gpus", "64", "--target-loss", "3.0", "--segments", "80",
        "--error-draws", "4"]  # fmt: skip


@pytest.fixture
def curves(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return write_synthetic_curves(tmp_path / "curves.json")


def test_the_table_has_every_plan_and_the_chain_runs(curves, tmp_path, capsys):
    assert main([*ARGS, "--curves", str(curves), "--out", "chain.json"]) == 0
    out = capsys.readouterr().out
    assert "SYNTHETIC (not measured)" in out and "64 GPUs (8 nodes of 8)" in out
    assert "12 published points" in out
    for row in ("static planner at the user's gbs", "tuned best fixed", "token ramp", "CONA online",
                "hindsight optimum", "over the perturbed worlds"):  # fmt: skip
        assert row in out
    config = ConaConfig(model=ModelConfig(**MODEL), training=TrainingConfig(base_gbs=8))
    chain = load_chain(tmp_path / "chain.json", config=config, world_size=64, dtype="bf16", workdir=tmp_path)
    assert chain.steps[0].gbs == 16 and chain.steps[-1].gbs > 16


@pytest.mark.parametrize(
    ("extra", "message", "code"),
    [
        (["--switch-cost-s", "3"], "--switch-cost-s does not go with --curves", 2),
        (["--initial-gbs", "24"], "has no curve at gbs 24", 1),
        (["--target-loss", "1.0"], "no curve reaches the target loss 1", 1),
        (["--error-draws", "0"], "--error-draws must be at least 1", 2),
    ],
)
def test_bad_inputs_are_one_line_errors(curves, capsys, extra, message, code):
    assert main([*ARGS, "--curves", str(curves), *extra]) == code
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_a_trace_plan_still_needs_its_flags(curves, capsys):
    assert main(["plan", "--system", "h100_80g", "--trace", "run"]) == 2
    assert "--out: required" in capsys.readouterr().err


def test_a_curves_file_is_json_only(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.json").write_text(json.dumps({"kind": "something else"}))
    assert main([*ARGS, "--curves", "c.json"]) == 1
    assert "kind: must be 'cona statistical curves'" in capsys.readouterr().err
