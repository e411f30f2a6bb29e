"""``cona ckpt inspect`` and ``cona ckpt export`` on a real small checkpoint."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from tests.helpers.workers import ckpt_worker

from cona.cli import main
from cona.config import parse_config
from cona.engine.checkpoint.paths import layout_dir
from cona.engine.checkpoint.save import save_checkpoint
from cona.engine.optim import build_optimizer
from cona.strategy import Strategy

STRATEGY = Strategy(dp=1, tp=1, pp=1, mbs=2, gbs=8, zero_stage=1)


@pytest.fixture
def checkpoint(tmp_path: Path):
    """A 1-process checkpoint of the stand-in GPT with the LM head tied to the token embedding."""
    config = parse_config({"model": ckpt_worker.SMALL, "training": {}})
    model = ckpt_worker.build_model(config, STRATEGY, None, 0.0)
    model.output.weight = model.tok_embeddings.weight
    optimizer = build_optimizer([model], config.training)
    ckpt_worker.train_step(model, optimizer, 1)
    state = {"iteration": 5, "consumed_samples": 40, "consumed_tokens": 320, "stage": 1}
    path = save_checkpoint(
        layout_dir(tmp_path, config, STRATEGY, "fp32", run_name="run"),
        iteration=5,
        model_parts=[model],
        optimizer=optimizer,
        trainer_state=state,
        config=config,
        strategy=STRATEGY,
    )
    return path, model


def test_inspect_json(checkpoint, capsys) -> None:
    path, _ = checkpoint
    assert main(["ckpt", "inspect", str(path.parent), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["path"] == str(path) and report["complete"] is True
    assert report["layout"] == {"dp": 1, "tp": 1, "pp": 1, "zero_stage": 1, "dtype": "fp32"}
    assert (report["iteration"], report["consumed_samples"], report["consumed_tokens"]) == (5, 40, 320)
    assert report["model"]["hidden"] == 16 and report["model"]["layers"] == 4
    assert report["size_bytes"] == sum(f.stat().st_size for f in path.iterdir())


def test_inspect_text_and_incomplete_exit_code(checkpoint, capsys) -> None:
    path, _ = checkpoint
    assert main(["ckpt", "inspect", str(path)]) == 0
    text = capsys.readouterr().out
    assert "iteration: 5" in text and "consumed_tokens: 320" in text and "complete: True" in text
    next(path.glob("*.distcp")).unlink()
    assert main(["ckpt", "inspect", str(path)]) == 1
    text = capsys.readouterr().out
    assert "complete: False" in text and "missing (the checkpoint's manifest.json lists it)" in text


def test_inspect_bad_path_is_one_line_error(tmp_path: Path, capsys) -> None:
    assert main(["ckpt", "inspect", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("cona: error: ") and "no 'latest' or 'latest_universal' marker" in err
    assert err.count("\n") == 1


def test_export_writes_consolidated_safetensors(checkpoint, tmp_path: Path, capsys) -> None:
    path, model = checkpoint
    out = tmp_path / "model.safetensors"
    assert main(["ckpt", "export", str(path.parent), str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    tensors = load_file(out)
    expected = {name: value.detach() for name, value in model.state_dict().items()}
    # The tied head is stored once, under the token embedding's name (the first of its group).
    assert set(expected) - set(tensors) == {"output.weight"}
    for name, value in tensors.items():
        assert torch.equal(value, expected[name]), name
    with safe_open(out, "pt") as handle:
        metadata = handle.metadata()
    assert json.loads(metadata["tied_parameters"]) == [["tok_embeddings.weight", "output.weight"]]
    assert metadata["iteration"] == "5"


def test_an_export_gets_the_mode_the_umask_gives(checkpoint, tmp_path: Path) -> None:
    path, _ = checkpoint
    previous = os.umask(0o022)
    try:
        assert main(["ckpt", "export", str(path), str(tmp_path / "shared.safetensors")]) == 0
        os.umask(0o077)
        assert main(["ckpt", "export", str(path), str(tmp_path / "private.safetensors")]) == 0
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "shared.safetensors").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "private.safetensors").stat().st_mode) == 0o600


def test_export_refuses_incomplete_checkpoint_and_bad_out(checkpoint, tmp_path: Path, capsys) -> None:
    path, _ = checkpoint
    assert main(["ckpt", "export", str(path), str(tmp_path / "x.bin")]) == 1
    assert "should end in .safetensors" in capsys.readouterr().err
    (path / ".metadata").unlink()
    assert main(["ckpt", "export", str(path), str(tmp_path / "x.safetensors")]) == 1
    assert (
        "global_step5/.metadata: missing (the checkpoint's manifest.json lists it)" in capsys.readouterr().err
    )
    assert not (tmp_path / "x.safetensors").exists()


def test_inspect_of_a_binary_file_is_one_line_error(tmp_path: Path, capsys) -> None:
    random_file = tmp_path / "random.bin"
    random_file.write_bytes(bytes(range(256)) * 4)
    assert main(["ckpt", "inspect", str(random_file)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("cona: error: ") and "not a checkpoint" in err and str(random_file) in err
    assert err.count("\n") == 1


def test_export_to_an_unwritable_path_is_one_line_error(checkpoint, tmp_path: Path, capsys) -> None:
    path, _ = checkpoint
    taken = tmp_path / "taken.safetensors"
    taken.mkdir()  # a directory where the file should go: safetensors cannot write it (even as root)
    assert main(["ckpt", "export", str(path), str(taken)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("cona: error: OUT: cannot write ") and str(taken) in err
    assert err.count("\n") == 1
