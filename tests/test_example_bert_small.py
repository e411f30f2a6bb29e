"""``examples/bert-small``: the BERT of the CPU quick start, whose step is CPU-sized, trains.

The shipped config runs as a user runs it (``cona train`` in a subprocess, torchrun, one CPU worker), its
model and training sections as shipped; only its data paths point at a corpus made here (a WordPiece
vocabulary trained on it and the corpus tokenized with it, as the README's commands do on the demo text).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.helpers.text_data import ENGLISH_SAMPLE, write_jsonl

from cona.config import ModelConfig
from cona.config.file import load_config
from cona.data.bert_vocab import train_bert_vocab
from cona.data.preprocess import PreprocessOptions, preprocess
from cona.data.tokenizer import BERT_WORDPIECE_LOWER
from cona.planner import flops

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "bert-small" / ".conaconfig"
LARGE = ROOT / "examples" / "bert" / ".conaconfig"
ITERATIONS = 3
QUICK_STEP_FLOP = 2e10
"""A quick start's training step at gbs 8: a second on one CPU core doing 20 GFLOP/s in fp32."""
QUICK_START_VOCAB = 4096
"""The vocabulary the README's quick start trains for it (``cona data bert-vocab --vocab-size 4096``)."""


def step_flop(config_path: Path, *, vocab_size: int, gbs: int = 8) -> float:
    model = ModelConfig(**json.loads(config_path.read_text())["model"] | {"vocab_size": vocab_size})
    return flops.training_flops_per_token(model) * gbs * model.seq


def test_a_small_bert_step_is_cpu_sized_and_bert_large_is_the_gpu_example() -> None:
    small = json.loads(EXAMPLE.read_text())
    large = json.loads(LARGE.read_text())
    assert small["model"]["family"] == large["model"]["family"] == "bert"
    assert (small["training"]["device"], small["training"]["dtype"]) == ("cpu", "fp32")
    assert "vocab_size" not in small["model"]  # taken from the vocab.txt the quick start trains
    small_step = step_flop(EXAMPLE, vocab_size=QUICK_START_VOCAB)
    assert small_step < QUICK_STEP_FLOP
    assert step_flop(LARGE, vocab_size=large["model"]["vocab_size"]) > 100 * QUICK_STEP_FLOP
    assert (large["training"]["device"], large["training"]["dtype"]) == ("cuda", "bf16")


@pytest.mark.slow
@pytest.mark.multiproc
def test_the_small_bert_example_trains_a_few_iterations(tmp_path: Path) -> None:
    data = tmp_path / "bert"
    sentences = [text.lower() for text in ENGLISH_SAMPLE if text.strip()]
    corpus = write_jsonl(
        tmp_path / "corpus.jsonl", [{"text": " ".join(sentences[i:] + sentences[:i])} for i in range(8)] * 40
    )
    vocab = train_bert_vocab(corpus, data, vocab_size=400).path
    preprocess(
        PreprocessOptions(
            input=corpus,
            output_prefix=str(data / "wiki"),
            vocab_file=vocab,
            tokenizer_type=BERT_WORDPIECE_LOWER,
            append_eod=True,
        )
    )
    data_keys = {
        "training.data_prefix": str(data / "wiki_text_document"),
        "training.vocab_file": str(vocab),
        "training.data_cache_path": str(tmp_path / "cache"),
    }
    overrides = [f"{key}={json.dumps(value)}" for key, value in data_keys.items()]
    load_config(EXAMPLE, check_data_files=True, overrides=overrides)  # the shipped config with its data
    command = [
        sys.executable, "-m", "cona", "train", "--config", str(EXAMPLE),
        "--dp", "1", "--tp", "1", "--pp", "1", "--gbs", "8", "--mbs", "8", "--iters", str(ITERATIONS),
        "--workdir", str(tmp_path), "--run-name", "small", "--quiet",
        *(part for override in overrides for part in ("--set", override)),
        "--set", f"training.log_root={json.dumps(str(tmp_path / 'logs'))}",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=os.environ)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    metrics = [
        json.loads(line) for line in (tmp_path / "logs" / "small" / "metrics.jsonl").read_text().splitlines()
    ]
    assert metrics[-1]["iteration"] == ITERATIONS
    assert all(record["loss"] > 0 for record in metrics)
