"""BERT's lower-case WordPiece: training a vocab.txt, loading it, preprocessing with it, and the config."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tests.helpers.text_data import ENGLISH_SAMPLE, write_jsonl

from cona.cli import main
from cona.config import parse_config
from cona.data.bert_vocab import train_bert_vocab
from cona.data.indexed import IndexedDataset
from cona.data.preprocess import PreprocessOptions, preprocess
from cona.data.tokenizer import BERT_WORDPIECE_LOWER, WORDPIECE_SPECIAL_TOKENS, load_wordpiece_tokenizer
from cona.errors import ConfigError, DataError

PLAIN_TEXTS = [
    "the quick brown fox jumps over the lazy dog.",
    "paris is the capital and most populous city of france.",
    "water is an inorganic compound with the chemical formula h2o.",
    "in 1905 albert einstein published four papers that changed physics.",
]
"""Lower-case text with single spaces and no space before punctuation: decoding gives it back exactly."""


@pytest.fixture(scope="module")
def vocab_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("wordpiece")
    corpus = write_jsonl(directory / "corpus.jsonl", [{"text": t} for t in ENGLISH_SAMPLE + PLAIN_TEXTS])
    train_bert_vocab(corpus, directory, vocab_size=400)
    return directory


def test_trained_vocab_puts_special_tokens_first_and_loads(vocab_dir: Path) -> None:
    lines = (vocab_dir / "vocab.txt").read_text(encoding="utf-8").splitlines()
    assert tuple(lines[: len(WORDPIECE_SPECIAL_TOKENS)]) == WORDPIECE_SPECIAL_TOKENS
    assert len(lines) == len(set(lines)) <= 400
    assert any(line.startswith("##") for line in lines)  # continuation pieces: a real WordPiece vocabulary
    tokenizer = load_wordpiece_tokenizer(vocab_dir / "vocab.txt")
    assert (tokenizer.pad_id, tokenizer.unk_id, tokenizer.cls_id, tokenizer.sep_id, tokenizer.mask_id) == (
        0,
        1,
        2,
        3,
        4,
    )
    assert tokenizer.vocab_size == len(lines)
    ids = tokenizer.encode("The Quick BROWN Fox")  # lower-cased, no [CLS]/[SEP] added
    assert tokenizer.decode(ids) == "the quick brown fox"
    assert not set(ids) & set(tokenizer.special_ids)


def test_special_ids_come_from_the_file(tmp_path: Path) -> None:
    tokens = ["hello", "[SEP]", "[UNK]", "world", "[MASK]", "[CLS]", "[PAD]", "##s"]
    (tmp_path / "vocab.txt").write_text("\n".join(tokens) + "\n", encoding="utf-8")
    tokenizer = load_wordpiece_tokenizer(tmp_path / "vocab.txt")
    assert (tokenizer.cls_id, tokenizer.sep_id, tokenizer.mask_id, tokenizer.pad_id, tokenizer.unk_id) == (
        5,
        1,
        4,
        6,
        2,
    )
    assert tokenizer.encode("Hello worlds") == [0, 3, 7]
    assert tokenizer.eod_id == tokenizer.sep_id


def test_a_missing_special_token_names_the_file(tmp_path: Path) -> None:
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\nhello\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"vocab\.txt: not a BERT WordPiece vocab\.txt: no \[MASK\] line"):
        load_wordpiece_tokenizer(vocab)
    with pytest.raises(DataError, match="does not exist"):
        load_wordpiece_tokenizer(tmp_path / "missing.txt")


def test_preprocessing_with_wordpiece_round_trips_text(vocab_dir: Path, tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "plain.jsonl", [{"text": t.upper()} for t in PLAIN_TEXTS])
    result = preprocess(
        PreprocessOptions(
            input=source,
            output_prefix=str(tmp_path / "out"),
            vocab_file=vocab_dir / "vocab.txt",
            tokenizer_type=BERT_WORDPIECE_LOWER,
            append_eod=True,
        ),
        show_progress=False,
    )
    tokenizer = load_wordpiece_tokenizer(vocab_dir / "vocab.txt")
    dataset = IndexedDataset(result.outputs["text"])
    assert dataset.dtype == np.uint16 and dataset.num_documents == len(PLAIN_TEXTS)
    for index, text in enumerate(PLAIN_TEXTS):
        ids = dataset.document(index).tolist()
        assert ids[-1] == tokenizer.sep_id  # --append-eod appends [SEP] for WordPiece
        assert tokenizer.decode(ids[:-1]) == text


def test_cli_trains_a_vocab_and_preprocesses_with_it(tmp_path: Path, capsys) -> None:
    corpus = write_jsonl(tmp_path / "corpus.jsonl", [{"text": t} for t in PLAIN_TEXTS * 3])
    out = tmp_path / "bert"
    assert (
        main(["data", "bert-vocab", "--corpus", str(corpus), "--out", str(out), "--vocab-size", "300"]) == 0
    )
    assert "vocab.txt" in capsys.readouterr().out
    args = ["preprocess", "--input", str(corpus), "--output-prefix", str(out / "wiki")]
    args += ["--vocab-file", str(out / "vocab.txt")]
    assert main([*args, "--tokenizer-type", BERT_WORDPIECE_LOWER]) == 0
    assert IndexedDataset(str(out / "wiki_text_document")).num_documents == len(PLAIN_TEXTS) * 3
    assert main(args) == 1  # GPT-2 BPE (the default type) needs --merge-file
    assert "--merge-file is required" in capsys.readouterr().err


def test_bert_vocab_refuses_bad_input(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="--corpus"):
        train_bert_vocab(tmp_path / "missing.jsonl", tmp_path, vocab_size=100)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text key"}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"bad\.jsonl, line 2: no string under key 'text'"):
        train_bert_vocab(bad, tmp_path, vocab_size=100)
    with pytest.raises(DataError, match="--vocab-size"):
        train_bert_vocab(bad, tmp_path, vocab_size=3)


def test_config_reads_the_vocab_size_of_a_vocab_txt(vocab_dir: Path) -> None:
    training = {"vocab_file": str(vocab_dir / "vocab.txt"), "tokenizer_type": BERT_WORDPIECE_LOWER}
    model = {"family": "bert", "layers": 1, "hidden": 8, "heads": 1, "seq": 16}
    config = parse_config({"model": model, "training": training})
    lines = (vocab_dir / "vocab.txt").read_text(encoding="utf-8").splitlines()
    assert config.model.vocab_size == len(lines)
    gpt2_training = {**training, "tokenizer_type": "GPT2BPETokenizer"}
    with pytest.raises(ConfigError, match="training.tokenizer_type: model.family 'bert' needs"):
        parse_config({"model": {**model, "vocab_size": 100}, "training": gpt2_training})
    assert json.loads(json.dumps(config.to_dict()))["training"]["tokenizer_type"] == BERT_WORDPIECE_LOWER
