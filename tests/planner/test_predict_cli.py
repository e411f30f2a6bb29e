"""``cona predict``: a flat JSON object or a table for one strategy; one-line errors for bad input."""

from __future__ import annotations

import json

import pytest

from cona.cli import main

CONFIG = {
    "model": {"layers": 24, "hidden": 2048, "heads": 16, "seq": 2048, "vocab_size": 50257},
    "training": {"zero_stage": 1, "dtype": "bf16"},
}
STRATEGY = ["--dp", "2", "--tp", "2", "--pp", "2", "--mbs", "2", "--gbs", "64"]


@pytest.fixture
def project(tmp_path, monkeypatch):
    (tmp_path / ".conaconfig").write_text(json.dumps(CONFIG))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_json_is_one_flat_object_with_the_splits(project, capsys):
    assert main(["predict", "--system", "a100_80g", *STRATEGY, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    splits = ("compute_s", "tp_comm_s", "pp_bubble_s", "pp_p2p_s", "dp_comm_exposed_s", "optimizer_s")
    assert out["iteration_time_s"] == pytest.approx(sum(out[k] for k in splits) + out["overhead_s"])
    memory = ("weights_gib", "grads_gib", "optimizer_gib", "activations_gib")
    assert out["memory_per_gpu_gib"] == pytest.approx(sum(out[k] for k in memory))
    assert (out["dp"], out["tp"], out["pp"], out["zero_stage"], out["dtype"]) == (2, 2, 2, 1, "bf16")
    assert all(not isinstance(v, dict | list) for v in out.values())


def test_flags_reach_the_strategy(project, capsys):
    args = [
        "predict",
        "--system",
        "h100_80g",
        *STRATEGY,
        "--json",
        "--recompute",
        "full",
        "--sequence-parallel",
        "--interleave",
        "3",
        "--zero-stage",
        "3",
        "--dtype",
        "fp16",
    ]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["recompute"], out["sequence_parallel"], out["pipeline_schedule"], out["virtual_stages"]) == (
        "full",
        True,
        "interleaved_1f1b",
        3,
    )
    assert (out["zero_stage"], out["dtype"]) == (3, "fp16")


def test_table_output(project, capsys):
    assert main(["predict", "--system", "a100_80g", *STRATEGY]) == 0
    out = capsys.readouterr().out
    assert "dp2/tp2/pp2 mbs2 gbs64 on a100_80g" in out and "pp_bubble" in out and "tokens/s" in out


@pytest.mark.parametrize(
    ("args", "message", "code"),  # 2: a usage error (a flag's value), 1: what the planner refuses
    [
        (
            ["--system", "a100_80g", "--dp", "1", "--tp", "3", "--pp", "1", "--mbs", "1", "--gbs", "1"],
            "tp=3 does not divide heads=16",
            1,
        ),
        (["--system", "tpu_v9", *STRATEGY], "unknown system 'tpu_v9'; available: a100_80g", 1),
        (["--system", "a100_80g", *STRATEGY, "--interleave", "0"], "--interleave", 2),
    ],
)
def test_bad_input_is_one_line(project, capsys, args, message, code):
    assert main(["predict", *args]) == code
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_config_by_path_and_missing_config(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["predict", "--system", "a100_80g", *STRATEGY]) == 1
    assert "no .conaconfig" in capsys.readouterr().err
    path = tmp_path / "other.json"
    path.write_text(json.dumps(CONFIG))
    assert main(["predict", "--system", "a100_80g", *STRATEGY, "--config", str(path), "--json"]) == 0


def test_unknown_vocabulary_names_the_key(tmp_path, monkeypatch, capsys):
    config = {"model": {key: value for key, value in CONFIG["model"].items() if key != "vocab_size"}}
    (tmp_path / ".conaconfig").write_text(json.dumps(config))
    monkeypatch.chdir(tmp_path)
    assert main(["predict", "--system", "a100_80g", *STRATEGY]) == 1
    err = capsys.readouterr().err
    assert "model.vocab_size" in err and err.count("\n") == 1


def test_schedule_defaults_to_the_config_and_flags_override_it(tmp_path, monkeypatch, capsys):
    training = {"pipeline_schedule": "interleaved_1f1b", "pipeline_virtual_stages": 2}
    (tmp_path / ".conaconfig").write_text(json.dumps({"model": CONFIG["model"], "training": training}))
    monkeypatch.chdir(tmp_path)
    runs = {
        (): ("interleaved_1f1b", 2),
        ("--interleave", "1"): ("1f1b", 1),
        ("--interleave", "3"): ("interleaved_1f1b", 3),
    }
    for flags, expected in runs.items():
        assert main(["predict", "--system", "a100_80g", *STRATEGY, "--json", *flags]) == 0
        out = json.loads(capsys.readouterr().out)
        assert (out["pipeline_schedule"], out["virtual_stages"]) == expected
        assert out["gpu_memory_gib"] == 80 and out["reserved_gib"] > 0
    assert main(["predict", "--system", "a100_80g", *STRATEGY, "--gpipe"]) == 2
    assert "--gpipe cannot be combined" in capsys.readouterr().err
    assert main(["predict", "--system", "a100_80g", *STRATEGY, "--gpipe", "--interleave", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["pipeline_schedule"] == "gpipe"
