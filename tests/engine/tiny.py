"""The tiny GPT the engine's single-process tests build, defined once here instead of once per test file."""

from __future__ import annotations

import torch

from cona.config import ConaConfig, ModelConfig, TrainingConfig
from cona.engine.parallel_dims import build_mesh
from cona.engine.train_model import TrainingModel, build_training_model
from cona.strategy import Strategy

TINY_MODEL = {"name": "gpt-tiny", "layers": 2, "hidden": 32, "heads": 4, "seq": 16, "vocab_size": 300}
"""The model section of a tiny ``.conaconfig`` (raw, for tests that parse a config or write a stage spec)."""


def tiny_config(*, seq: int = 8, seed: int = 3) -> ConaConfig:
    """Two blocks of width 32, a 64-token vocabulary and no dropout (so steps are deterministic), on CPU."""
    return ConaConfig(
        model=ModelConfig(
            layers=2, hidden=32, heads=2, seq=seq, vocab_size=64, attention_dropout=0.0, hidden_dropout=0.0
        ),
        training=TrainingConfig(device="cpu", seed=seed),
    )


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
