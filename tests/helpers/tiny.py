"""The tiny GPT the tests train, configured in one place: a raw ``.conaconfig`` dict, a parsed
:class:`ConaConfig` or a file with a dataset beside it, each with keyword overrides for the tests that need
another shape (the ``tiny_config_file`` fixture of tests/conftest.py writes the file into a test's tmp_path).

The default is two blocks of width 32, 4 heads, seq 16 and a 300-token vocabulary, without dropout (steps are
deterministic), trained in fp32 on CPU at base gbs 8 and base LR 1e-3."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from cona.config import ConaConfig, parse_config
from cona.data.indexed import IndexedDatasetWriter
from cona.engine.parallel_dims import build_mesh
from cona.engine.train_model import TrainingModel, build_training_model
from cona.strategy import Strategy

ROOT = Path(__file__).resolve().parents[2]

TINY_MODEL = {
    "name": "gpt-tiny",
    "layers": 2,
    "hidden": 32,
    "heads": 4,
    "seq": 16,
    "vocab_size": 300,
    "attention_dropout": 0.0,
    "hidden_dropout": 0.0,
}
"""The model section of the tiny ``.conaconfig``."""

TINY_TRAINING = {
    "device": "cpu",
    "dtype": "fp32",
    "base_gbs": 8,
    "base_lr": 1e-3,
    "base_min_lr": 1e-4,
    "log_root": "logs",
}
"""The training section of the tiny ``.conaconfig`` (no dataset: for tests that never read one)."""

RANDOM_DATA_TRAINING = {
    "lr_warmup_tokens": 64,
    "split": "90,10,0",
    "data_prefix": "data/tiny",
    "log_interval": 2,
    "eval_interval": 2,
    "eval_iters": 1,
}
"""The training keys of a run on ``data/tiny``, 300 documents of 10 to 59 uniformly random tokens."""

MARKOV_VOCAB = 256
SUCCESSOR_PROBS = (0.55, 0.25, 0.15, 0.05)
"""Each token of the Markov dataset is followed by one of 4 fixed tokens with these probabilities (entropy
1.1 nats): its tokens are learnable, so the loss falls steadily from ln(MARKOV_VOCAB), and a model restarted
from scratch at a switch shows as a jump."""
MARKOV_SEQ = 32

EXAMPLE = json.loads((ROOT / "examples" / "tiny" / ".conaconfig").read_text())
"""examples/tiny/.conaconfig: its model's name, layers, hidden and heads and its zero stage give the layouts
and pruning paths of the example chains."""

MARKOV_MODEL = {**EXAMPLE["model"], "seq": MARKOV_SEQ, "vocab_size": MARKOV_VOCAB}
MARKOV_TRAINING = {
    "seed": 7,
    "zero_stage": EXAMPLE["training"]["zero_stage"],
    "base_lr": 3e-3,
    "base_min_lr": 3e-4,
    "lr_warmup_tokens": 256,
    "split": "90,10,0",
    "data_prefix": "data/markov",
    "log_interval": 1,
    "eval_interval": 1_000_000,
    "eval_iters": 1,
}
"""The training keys of a run on ``data/markov``: a metrics line every iteration and no evaluation (the
losses the tests compare are training losses)."""

Data = Literal["random", "markov"] | None


def tiny_raw(*, model: dict | None = None, training: dict | None = None) -> dict:
    """The tiny ``.conaconfig`` as a dict, ``model`` and ``training`` replacing its keys."""
    return {"model": {**TINY_MODEL, **(model or {})}, "training": {**TINY_TRAINING, **(training or {})}}


def tiny_config(*, model: dict | None = None, training: dict | None = None) -> ConaConfig:
    """The tiny config parsed (paths in it are not resolved: no file was read)."""
    return parse_config(tiny_raw(model=model, training=training), source=None)


def write_tiny_config(
    directory: Path,
    *,
    data: Data = None,
    model: dict | None = None,
    training: dict | None = None,
    documents: int = 300,
    seed: int = 0,
) -> Path:
    """``directory/.conaconfig`` of the tiny config; returns its path.

    ``data="random"`` also writes ``directory/data/tiny`` (``documents`` random-token documents) and trains
    on it; ``data="markov"`` writes ``directory/data/markov`` (``documents`` documents of a Markov chain drawn
    with ``seed``) and trains the example's model shape at seq 32 on it. ``model`` and ``training`` replace
    keys last."""
    if data == "random":
        write_random_dataset(directory / "data" / "tiny", documents=documents, seed=seed)
        base_model, base_training = {}, RANDOM_DATA_TRAINING
    elif data == "markov":
        write_markov_dataset(directory / "data" / "markov", documents=documents, seed=seed)
        base_model, base_training = MARKOV_MODEL, MARKOV_TRAINING
    else:
        base_model, base_training = {}, {}
    raw = tiny_raw(model={**base_model, **(model or {})}, training={**base_training, **(training or {})})
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / ".conaconfig"
    path.write_text(json.dumps(raw, indent=1))
    return path


def write_random_dataset(prefix: Path, *, documents: int, seed: int) -> None:
    """``documents`` documents of 10 to 59 tokens drawn uniformly from the tiny vocabulary."""
    rng = np.random.default_rng(seed)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for _ in range(documents):
            writer.add_document(rng.integers(0, TINY_MODEL["vocab_size"], size=int(rng.integers(10, 60))))


def write_markov_dataset(prefix: Path, *, documents: int, seed: int) -> None:
    """``documents`` documents of 50 to 199 tokens of a fixed random Markov chain (``SUCCESSOR_PROBS``)."""
    rng = np.random.default_rng(seed)
    successors = np.stack(
        [rng.choice(MARKOV_VOCAB, size=len(SUCCESSOR_PROBS), replace=False) for _ in range(MARKOV_VOCAB)]
    )
    prefix.parent.mkdir(parents=True, exist_ok=True)
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for _ in range(documents):
            length = int(rng.integers(50, 200))
            choices = rng.choice(len(SUCCESSOR_PROBS), size=length - 1, p=SUCCESSOR_PROBS)
            tokens = [int(rng.integers(MARKOV_VOCAB))]
            for choice in choices:
                tokens.append(int(successors[tokens[-1], choice]))
            writer.add_document(np.asarray(tokens))


def tiny_engine(gbs: int, mbs: int, config: ConaConfig | None = None) -> TrainingModel:
    """The engine of ``config`` (default :func:`tiny_config`) at dp = tp = pp = 1 on the process group the
    test holds (the ``one_process_group`` fixture)."""
    strategy = Strategy(dp=1, tp=1, pp=1, mbs=mbs, gbs=gbs)
    config = config if config is not None else tiny_config()
    return build_training_model(config, strategy, build_mesh(strategy, "cpu"), torch.device("cpu"))


def recorded_stances(monkeypatch) -> list[str]:
    """The stances ``torch.compiler.set_stance`` is given from now on in the test (e.g. "force_eager", which
    the engine sets where a step cannot run in the compiled graph)."""
    stances, set_stance = [], torch.compiler.set_stance

    def recording(stance, **kwargs):
        stances.append(stance)
        return set_stance(stance, **kwargs)

    monkeypatch.setattr(torch.compiler, "set_stance", recording)
    return stances
