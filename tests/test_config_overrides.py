"""``--set SECTION.KEY=VALUE``: parsed once in config loading, validated like a key of the file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cona.cli import main
from cona.config.file import load_config
from cona.config.overrides import parse_override
from cona.errors import ConfigError, UsageError


@pytest.fixture
def config_path(tmp_path: Path, tiny_config_file) -> Path:
    return tiny_config_file(tmp_path / "cfg")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("training.base_lr=3e-4", ("training", "base_lr", 3e-4)),
        ("training.fallback=true", ("training", "fallback", True)),
        ("training.lr_decay_tokens=null", ("training", "lr_decay_tokens", None)),
        ("model.layers=12", ("model", "layers", 12)),
        ("training.dtype=fp32", ("training", "dtype", "fp32")),  # not JSON: the string itself
        ("training.split=98,2,0", ("training", "split", "98,2,0")),
        ('model.name="123"', ("model", "name", "123")),  # quoted: a string that looks like a number
        ("training.x=[1, 2]", ("training", "x", [1, 2])),
    ],
)
def test_values_are_json_when_they_parse_else_strings(text, expected):
    assert parse_override(text) == expected


def test_overrides_replace_the_files_keys_and_the_last_one_wins(config_path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    overrides = ["training.base_lr=3e-4", "model.layers=3", "training.log_root=mine", "model.layers=4"]
    config = load_config(config_path, overrides=overrides)
    assert config.training.lr.base_lr == 3e-4 and config.model.layers == 4
    assert config.training.logging.log_root == str(tmp_path / "mine")  # relative to the cwd, not to the file
    assert config.overrides == tuple(overrides)
    assert load_config(config_path).training.lr.base_lr == 1e-3  # the file is untouched


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("training.base_lrr=1", "unknown key 'training.base_lrr'; did you mean 'training.base_lr'?"),
        ("optim.lr=1", "unknown section 'optim'"),
        ("base_lr=1", "expected SECTION.KEY=VALUE"),
        ("training.base_lr", "expected SECTION.KEY=VALUE"),
    ],
)
def test_unknown_keys_and_bad_forms_are_refused_naming_them(config_path, text, message):
    with pytest.raises(UsageError, match=message.replace("?", r"\?").replace("[", r"\[")) as info:
        load_config(config_path, overrides=[text])
    assert f"--set {text}" in str(info.value) or f"--set {text!r}" in str(info.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("training.base_lr=-1", "training.base_lr: must be positive"),
        ("training.log_interval=often", "training.log_interval: expected an integer"),
        ("training.dtype=fp8", "training.dtype: 'fp8' is not one of"),
        ('training.base_lr="3e-4"', "training.base_lr: expected a number, got the string '3e-4'"),
    ],
)
def test_values_go_through_the_configs_own_validation(config_path, text, message):
    with pytest.raises(ConfigError) as info:
        load_config(config_path, overrides=[text])
    assert message in str(info.value) and f"--set {text}" in str(info.value)


def test_config_show_strategies_and_predict_take_set(config_path, capsys):
    assert main(["config", "show", "--config", str(config_path), "--set", "model.layers=7"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["layers"] == 7
    predict = ["predict", "--system", "a100_80g", "--dp", "1", "--tp", "1", "--pp", "1", "--mbs", "1"]
    predict += ["--gbs", "1", "--config", str(config_path), "--json"]
    assert main(predict) == 0
    base = json.loads(capsys.readouterr().out)
    assert main([*predict, "--set", "model.layers=8"]) == 0
    assert json.loads(capsys.readouterr().out)["weights_gib"] > base["weights_gib"]  # 8 layers, not 2
    strategies = ["strategies", "--gpus", "2", "--system", "a100_80g", "--gbs", "4"]
    assert main([*strategies, "--config", str(config_path), "--no-botorch", "--set", "model.heads=3"]) == 1
    assert "model.hidden: 32 is not divisible by model.heads=3" in capsys.readouterr().err


def test_train_takes_set_and_the_other_nodes_get_it(tmp_path, monkeypatch, capsys, tiny_config_file):
    from cona.runner.nodes.multinode import cona_command

    config = tiny_config_file(data="random")
    captured = []
    monkeypatch.setattr("cona.runner.schedules.online.run_online", lambda run, **_: captured.append(run))
    online = ["train", "--config", str(config), "--system", "cpu_gloo", "--initial-gbs", "2", "--gpus", "2"]
    online += ["--total-iters", "4", "--set", "training.base_lr=5e-4"]
    assert main(online) == 0, capsys.readouterr().err
    (run,) = captured
    assert run.config.training.lr.base_lr == 5e-4
    command = cona_command(
        run.mode_args(), config=run.config, nodes=run.nodes, run_dir=run.run_dir, workdir=tmp_path,
        base_port=29400, quiet=False,
    )  # fmt: skip
    assert command[command.index("--set") + 1] == "training.base_lr=5e-4"
    assert main([*online[:-1], "training.base_lrr=5e-4"]) == 2
    assert "unknown key 'training.base_lrr'" in capsys.readouterr().err
