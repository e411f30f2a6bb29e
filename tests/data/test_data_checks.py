"""The dataset checks made before any worker starts: an empty validation split, token ids past the
vocabulary."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from tests.data.test_data_gpt_dataset import make_config, write_documents

from cona.cli import main
from cona.data.checks import check_dataset
from cona.data.indexed import IndexedDatasetWriter
from cona.errors import DataError


@pytest.fixture
def corpus(tmp_path: Path) -> list[np.ndarray]:
    return write_documents(tmp_path / "docs", [30] * 40)  # ids up to 100 * 39 + 29 = 3929


def test_a_fitting_dataset_passes(tmp_path: Path, corpus) -> None:
    check_dataset(make_config(tmp_path, split="80,15,5"))


@pytest.mark.parametrize(
    ("keys", "named"), [({"split": "100,0,0"}, "'100,0,0'"), ({"seq": 100000}, "100000")]
)
def test_a_validation_split_without_a_sample_is_refused(tmp_path: Path, corpus, keys, named) -> None:
    with pytest.raises(DataError) as caught:
        check_dataset(make_config(tmp_path, **keys))
    message = str(caught.value)
    assert message.startswith(f"{tmp_path / '.conaconfig'}: training.split ") and named in message
    assert "leaves the validation split no sample" in message and str(tmp_path / "docs") in message


def test_token_ids_past_the_vocabulary_are_refused(tmp_path: Path, corpus) -> None:
    config = make_config(tmp_path)
    with_vocab = lambda size: dataclasses.replace(
        config, model=dataclasses.replace(config.model, vocab_size=size)
    )
    with pytest.raises(DataError, match=r"docs\.bin holds token id 3929, but model\.vocab_size is 3929"):
        check_dataset(with_vocab(3929))
    check_dataset(with_vocab(3930))  # the largest id is 3929


def test_an_int32_dataset_is_scanned_past_chunks(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr("cona.data.checks.CHUNK_TOKENS", 7)
    with IndexedDatasetWriter(tmp_path / "docs", np.int32) as writer:
        for d in range(20):
            writer.add_document(np.arange(30, dtype=np.int64) + (70000 if d == 17 else 0))
    config = make_config(tmp_path)
    with pytest.raises(DataError, match="holds token id 70000, but model.vocab_size is 65000"):
        check_dataset(config)


def test_cona_train_refuses_before_starting_a_worker(tmp_path: Path, corpus, capsys) -> None:
    raw = {
        "model": {"layers": 1, "hidden": 8, "heads": 1, "seq": 16, "vocab_size": 10},
        "training": {"data_prefix": str(tmp_path / "docs"), "log_root": str(tmp_path / "logs")},
    }
    config = tmp_path / ".conaconfig"
    config.write_text(json.dumps(raw))
    flags = ["--dp", "1", "--tp", "1", "--pp", "1", "--gbs", "2", "--mbs", "2", "--iters", "1"]
    argv = ["train", "--config", str(config), *flags, "--workdir", str(tmp_path), "--device", "cpu"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "model.vocab_size" in err and "docs.bin holds token id" in err and err.count("\n") == 1
    assert not (tmp_path / "logs").exists()  # no run directory: nothing was launched
