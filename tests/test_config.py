"""`.conaconfig` loading and validation: every bad input names the file and the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cona.cli import main
from cona.config import ModelConfig, TrainingConfig, parse_config
from cona.config.file import find_config, load_config
from cona.config.training import SECTION_OF, split_fractions
from cona.errors import ConfigError

MODEL = {"name": "t", "layers": 2, "hidden": 64, "heads": 4, "seq": 32}


def write(tmp_path: Path, model: dict | None = None, training: dict | None = None, **top) -> Path:
    body = {"model": MODEL if model is None else model, "training": training or {}, **top}
    path = tmp_path / ".conaconfig"
    path.write_text(json.dumps(body))
    return path


def error_of(path: Path, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_defaults_follow_the_seed(tmp_path):
    config = load_config(write(tmp_path))
    assert config.model.ffn_size == 4 * 64
    assert config.training.lr.lr_warmup_frac == 0.01 and config.training.lr.lr_warmup_tokens is None
    assert config.training.data.split == "949,50,1"
    assert config.path == tmp_path / ".conaconfig"


def test_found_in_a_parent_directory(tmp_path, monkeypatch):
    path = write(tmp_path)
    nested = tmp_path / "a" / "b"
    nested.mkdir(parents=True)
    monkeypatch.chdir(nested)
    assert find_config() == path
    assert load_config().model.name == "t"


def test_no_config_anywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="no .conaconfig"):
        find_config(tmp_path)


def test_relative_paths_are_relative_to_the_file(tmp_path):
    (tmp_path / "vocab.json").write_text(json.dumps({"a": 0, "b": 1, "c": 2}))
    config = load_config(write(tmp_path, training={"vocab_file": "vocab.json", "data_prefix": "d/x"}))
    assert config.training.data.vocab_file == str(tmp_path / "vocab.json")
    assert config.training.data.data_prefix == str(tmp_path / "d" / "x")
    assert config.model.vocab_size == 3
    assert config.model.padded_vocab_size == 128


@pytest.mark.parametrize(
    ("model", "training", "expected"),
    [
        ({**MODEL, "hiden": 64}, {}, "unknown key 'model.hiden'; did you mean 'model.hidden'?"),
        (MODEL, {"base_lrr": 1e-3}, "unknown key 'training.base_lrr'; did you mean 'training.base_lr'?"),
        ({**MODEL, "layers": "<num_layers>"}, {}, "model.layers: '<num_layers>' is a placeholder"),
        ({**MODEL, "layers": "24"}, {}, "model.layers: expected an integer, got the string '24'"),
        (MODEL, {"base_lr": "3e-4"}, "training.base_lr: expected a number, got the string '3e-4'"),
        ({**MODEL, "layers": 2.5}, {}, "model.layers: expected an integer, got 2.5"),
        (MODEL, {"fallback": 1}, "training.fallback: expected true or false, got 1"),
        ({**MODEL, "hidden": 66}, {}, "model.hidden: 66 is not divisible by model.heads=4"),
        (MODEL, {"base_lr": 1e-5, "base_min_lr": 1e-4}, "training.base_lr: 1e-05 is smaller than"),
        (MODEL, {"lr_scale_strategy": "cubic"}, "training.lr_scale_strategy: 'cubic' is not one of"),
        (MODEL, {"dtype": "fp8"}, "training.dtype: 'fp8' is not one of 'fp32', 'bf16', 'fp16'"),
        (MODEL, {"split": "90,10"}, "training.split: expected three numbers"),
        (MODEL, {"split": "90,-10,0"}, "training.split: weights must be non-negative"),
        (MODEL, {"zero_stage": 4}, "training.zero_stage: 4 is not one of 0, 1, 2, 3"),
        (MODEL, {"lr_scale_strategy": "piecewise"}, "training.lr_scale_pivot_gbs: is required"),
        ({k: v for k, v in MODEL.items() if k != "heads"}, {}, "missing required key 'model.heads'"),
        (MODEL, {"device": "tpu"}, "training.device: 'tpu' is not one of"),
        (MODEL, {"save_interval": 0}, "training.save_interval: must be positive (or null"),
        (MODEL, {"save_interval_minutes": -5}, "training.save_interval_minutes: must be positive (or null"),
        (MODEL, {"keep_checkpoints": 0}, "training.keep_checkpoints: must be positive"),
        (MODEL, {"probe_tolerance": -0.1}, "training.probe_tolerance: must be non-negative"),
        (MODEL, {"probe_tokens": 0}, "training.probe_tokens: must be positive"),
        (MODEL, {"noise_scale_factor": 0.0}, "training.noise_scale_factor: must be positive"),
    ],
)
def test_bad_values_name_the_key_and_file(tmp_path, model, training, expected):
    message = error_of(write(tmp_path, model=model, training=training))
    assert expected in message
    assert str(tmp_path / ".conaconfig") in message


def test_unknown_section_and_bad_json(tmp_path):
    assert "unknown key 'trainin'; did you mean 'training'?" in error_of(write(tmp_path, trainin={}))
    bad = tmp_path / "bad.json"
    bad.write_text('{"model": {')
    assert "not valid JSON" in error_of(bad)


def test_missing_data_files_are_refused_when_training(tmp_path):
    path = write(tmp_path, training={"data_prefix": "nowhere/corpus_text_document"})
    load_config(path)  # fine for commands that do not read data
    message = error_of(path, check_data_files=True)
    assert "training.data_prefix" in message and "nowhere/corpus_text_document.bin does not exist" in message


def test_missing_vocab_file_leaves_vocab_unknown_until_needed(tmp_path):
    config = load_config(write(tmp_path, training={"vocab_file": "missing.json"}))
    assert config.model.vocab_size is None
    with pytest.raises(ConfigError, match="model.vocab_size is not known"):
        _ = config.model.padded_vocab_size


def test_split_fractions():
    assert split_fractions("949,50,1") == pytest.approx((0.949, 0.05, 0.001))
    assert split_fractions("1/1/0") == pytest.approx((0.5, 0.5, 0.0))


def test_config_show_prints_resolved_values(tmp_path, capsys):
    path = write(tmp_path, model={**MODEL, "vocab_size": 1000})
    assert main(["config", "show", "--config", str(path)]) == 0
    captured = capsys.readouterr()
    resolved = json.loads(captured.out)  # stdout is valid JSON, the file is named on stderr
    assert captured.err == f"# {path}\n"
    assert resolved["model"]["ffn_hidden"] == 256
    assert resolved["model"]["padded_vocab_size"] == 1024


def test_cli_error_is_one_line_without_traceback(tmp_path, capsys):
    path = write(tmp_path, model={**MODEL, "heads": "<heads>"})
    assert main(["config", "show", "--config", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("cona: error: ") and "Traceback" not in err and err.count("\n") == 1


def test_default_log_root_is_relative_to_the_file(tmp_path, monkeypatch):
    path = write(tmp_path)
    monkeypatch.chdir("/")
    assert load_config(path).training.logging.log_root == str(tmp_path / "logs")


@pytest.mark.parametrize(
    "name", ["../../..", "/tmp/elsewhere", "a/b", "..", ".", "", ".hidden", "a\\b", "-x"]
)
def test_model_name_must_be_one_directory_name(tmp_path, name):
    message = error_of(write(tmp_path, model={**MODEL, "name": name}))
    assert message.startswith(
        f"{tmp_path / '.conaconfig'}: model.name: {name!r} is not a plain directory name"
    )


@pytest.mark.parametrize("name", ["gpt-tiny", "gpt3-1.3b", "llama-3.2-1b", "m", "Run_2+x"])
def test_ordinary_model_names_are_accepted(tmp_path, name):
    assert load_config(write(tmp_path, model={**MODEL, "name": name})).model.name == name


def test_a_duplicate_key_is_refused_naming_it(tmp_path):
    path = tmp_path / ".conaconfig"
    text = json.dumps({"model": MODEL, "training": {"base_lr": 1e-4}})
    path.write_text(text.replace('"base_lr": 0.0001', '"base_lr": 0.0001, "base_lr": 0.1'))
    assert error_of(path) == f"{path}: key 'base_lr' appears twice; keep one"


def test_config_naming_a_directory_says_so(tmp_path):
    message = error_of(tmp_path)
    assert "is a directory, not a .conaconfig file" in message and "does not exist" not in message
    write(tmp_path)
    assert error_of(tmp_path).endswith(f"did you mean {tmp_path / '.conaconfig'}?")


def test_a_run_is_identified_by_the_keys_that_differ_from_their_defaults(tmp_path):
    """A key written at its default, or one a later CONA adds at its default, leaves the identity (the run
    directory's config digest) as it was; a changed value does not."""
    plain = load_config(write(tmp_path, training={"base_gbs": 8}))
    spelled = load_config(write(tmp_path, training={"base_gbs": 8, "fallback": False}))
    changed = load_config(write(tmp_path, training={"base_gbs": 8, "fallback": True}))
    assert plain.identity_dict() == spelled.identity_dict() != changed.identity_dict()
    # log_root is resolved against the file's folder, so it is always spelled out.
    assert set(plain.identity_dict()["training"]) == {"base_gbs", "log_root"}
    assert set(changed.identity_dict()["training"]) == {"base_gbs", "log_root", "fallback"}
    assert MODEL.items() <= plain.identity_dict()["model"].items()
    assert "probe_tokens" in plain.to_dict()["training"]


def test_the_flat_training_section_is_read_into_its_sections(tmp_path):
    """The file writes training keys flat, as the original CONA does; each lands in its section, and the
    config writes them back flat (config show, a checkpoint's config.json) to the same config."""
    flat = {
        "weight_decay": 0.05,
        "base_lr": 3e-4,
        "split": "98,2,0",
        "eval_iters": 3,
        "keep_checkpoints": 4,
        "probe_tokens": 4096,
        "device": "cpu",
    }
    config = load_config(write(tmp_path, training=flat))
    training = config.training
    assert training.optimizer.weight_decay == 0.05 and training.lr.base_lr == 3e-4
    assert training.data.split == "98,2,0" and training.logging.eval_iters == 3
    assert training.checkpoint.keep_checkpoints == 4 and training.online.probe_tokens == 4096
    assert training.runtime.device == "cpu"
    written = config.to_dict()["training"]
    assert list(written) == list(SECTION_OF) and flat.items() <= written.items()
    assert parse_config(config.to_dict(), source=config.path) == config


def test_sections_check_their_values_when_built_in_code():
    with pytest.raises(ConfigError, match=r"^training.base_lr: must be positive$"):
        TrainingConfig(base_lr=-1.0)
    with pytest.raises(ConfigError, match=r"^training.probe_tokens: must be positive$"):
        TrainingConfig().replace(probe_tokens=0)
    with pytest.raises(ConfigError, match=r"^model.hidden: 66 is not divisible by model.heads=4$"):
        ModelConfig(layers=2, hidden=66, heads=4, seq=8)
    with pytest.raises(TypeError, match="base_lrr"):
        TrainingConfig(base_lrr=1.0)
    changed = TrainingConfig(seed=7).replace(base_lr=1e-3)
    assert (changed.runtime.seed, changed.lr.base_lr) == (7, 1e-3)
    assert changed.explicit_flat() == {"seed": 7, "base_lr": 1e-3}


def test_bert_needs_the_wordpiece_tokenizer(tmp_path):
    message = error_of(write(tmp_path, model={**MODEL, "family": "bert"}))
    refusal = "training.tokenizer_type: model.family 'bert' needs 'BertWordPieceLowerCase'"
    assert message.startswith(f"{tmp_path / '.conaconfig'}: {refusal} (masked-LM samples use")
