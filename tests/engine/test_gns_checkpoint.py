"""On a real GPT at a fixed checkpoint, the halves of measured gbs = mbs steps give the noise scale that
k = 16 micro-batch gradients at the same parameters give (without the halves, a gbs = mbs step on one rank
has no small batch and so no estimate)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tests.helpers.tiny import tiny_config

from cona.engine.optim import build_optimizer, set_lr
from cona.engine.parallel_dims import build_mesh
from cona.engine.train_model import TrainingModel, build_training_model
from cona.planner.efficiency import NoiseScaleTracker, two_batch_estimate
from cona.strategy import Strategy

VOCAB, SEQ = 64, 16
CONFIG = tiny_config(model={"seq": SEQ, "vocab_size": VOCAB}, training={"seed": 11})


class MarkovText:
    """Token sequences of a fixed sparse bigram chain: text a model can learn, so its gradient has signal."""

    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.successors = rng.integers(0, VOCAB, size=(VOCAB, 4))
        self.rng = rng

    def rows(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = np.empty((count, SEQ + 1), dtype=np.int64)
        tokens[:, 0] = self.rng.integers(0, VOCAB, size=count)
        for position in range(1, SEQ + 1):
            choice = self.rng.integers(0, 4, size=count)
            tokens[:, position] = self.successors[tokens[:, position - 1], choice]
        tensor = torch.from_numpy(tokens)
        return tensor[:, :-1].contiguous(), tensor[:, 1:].contiguous()


def engine(gbs: int, mbs: int) -> TrainingModel:
    strategy = Strategy(dp=1, tp=1, pp=1, mbs=mbs, gbs=gbs)
    return build_training_model(CONFIG, strategy, build_mesh(strategy, "cpu"), torch.device("cpu"))


def checkpoint(text: MarkovText) -> dict[str, torch.Tensor]:
    """The weights after 40 AdamW steps at gbs 8: the loss has fallen well below log(VOCAB)."""
    trainer = engine(gbs=8, mbs=8)
    optimizer = build_optimizer(trainer.model_parts, CONFIG.training)
    set_lr(optimizer, 3e-3)
    for _ in range(40):
        last = trainer.train_step_pending([text.rows(8)], measure_gns=False).result()
        bool(trainer.optimizer_step_pending(optimizer).item())
    assert last.loss < 0.9 * np.log(VOCAB)
    return trainer.model_parts[0].state_dict()


def test_halves_match_the_exact_estimate_of_16_micro_batches(one_process_group) -> None:
    text = MarkovText(seed=0)
    weights = checkpoint(text)
    exact, halves = engine(gbs=128, mbs=8), engine(gbs=16, mbs=16)
    for model in (exact, halves):
        model.model_parts[0].load_state_dict(weights)
    # Exact: 16 micro-batch gradients of 8 sequences per step, the ratio of the averaged estimates (16 steps:
    # a spread of about 4% between independent draws, against the 25% the halves must come within).
    outs = [exact.train_step_pending([text.rows(8) for _ in range(16)]).result() for _ in range(16)]
    grad_sqr, trace_sigma = two_batch_estimate(
        np.array([o.gns_small_sqr for o in outs]), np.array([o.gns_big_sqr for o in outs]), 8, 128
    )
    reference = trace_sigma.mean() / grad_sqr.mean()
    # The run's path: one micro-batch of 16 per step, measured as two halves, through the tracker.
    tracker = NoiseScaleTracker(base_batch=16, window=math.inf)  # fixed parameters: every measurement counts
    for _ in range(100):  # 100 steps: a spread of about 10% between independent draws
        out = halves.train_step_pending(
            [text.rows(16)]
        ).result()  # no optimizer step: the parameters stay fixed
        assert (out.gns_small_batch, out.gns_big_batch) == (8, 16)
        tracker = tracker.update(
            small_sqr=out.gns_small_sqr,
            big_sqr=out.gns_big_sqr,
            small_batch=8,
            big_batch=16,
            consumed_samples=0,
        )
    assert reference > 1.0  # a noise scale the test can tell apart from 0
    assert tracker.noise_scale() == pytest.approx(reference, rel=0.25)
