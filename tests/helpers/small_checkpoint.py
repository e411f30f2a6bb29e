"""A small model of the checkpoint worker's shape (``ckpt_worker.SMALL``), trained and saved in this
process at one layout, for the checkpoint tests that need a real checkpoint without torchrun."""

from __future__ import annotations

from pathlib import Path

import torch
from tests.helpers.workers import ckpt_worker
from torch import nn

from cona.config import ConaConfig, parse_config
from cona.engine.checkpoint.paths import layout_dir
from cona.engine.checkpoint.save import save_checkpoint
from cona.engine.optim import build_optimizer
from cona.strategy import Strategy

ONE = Strategy(dp=1, tp=1, pp=1, mbs=1, gbs=4)


def small_config(**model_overrides) -> ConaConfig:
    """The checkpoint worker's small model (``model_overrides`` replacing its keys) with default training."""
    return parse_config({"model": {**ckpt_worker.SMALL, **model_overrides}, "training": {}})


def trained(config: ConaConfig, steps: int = 2, offset: float = 0.0):
    """The model of ``config`` (weights shifted by ``offset``) and its optimizer after ``steps`` steps."""
    model = ckpt_worker.build_model(config, ONE, None, offset)
    optimizer = build_optimizer([model], config.training)
    for step in range(1, steps + 1):
        ckpt_worker.train_step(model, optimizer, step)
    return model, optimizer


def save(root: Path, config: ConaConfig, model, optimizer, iteration: int) -> Path:
    """A checkpoint of ``model`` and ``optimizer`` at ``iteration``, in run "run"'s layout under ``root``."""
    return save_checkpoint(
        layout_dir(root, config, ONE, "fp32", run_name="run"),
        iteration=iteration,
        model_parts=[model],
        optimizer=optimizer,
        trainer_state={"iteration": iteration, "consumed_tokens": 64},
        config=config,
        strategy=ONE,
    )


def assert_same_state(a: tuple[nn.Module, torch.optim.Optimizer], b: tuple[nn.Module, torch.optim.Optimizer]):
    """The two (model, optimizer) pairs hold equal tensors under the same names."""
    expected, actual = ckpt_worker.full_state([a[0]], a[1]), ckpt_worker.full_state([b[0]], b[1])
    assert set(expected) == set(actual)
    for key, value in expected.items():
        assert torch.equal(actual[key], value), key
