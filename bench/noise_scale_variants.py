"""``B_simple`` of a GPT three ways: raw gradients, Adam-preconditioned ones, and with the embedding.

The engine measures the noise scale on the raw gradients of every parameter but the embedding/LM-head
matrix (:mod:`cona.engine.gns`). AdaptDL's Adam variant divides each gradient element by Adam's
bias-corrected ``sqrt(v) + eps`` first. This trains a GPT with AdamW on the bench corpus and, at a few
steps, takes ``k`` micro-batch gradients of ``m`` samples at fixed parameters and prints the unbiased
``B_simple = tr(Sigma) / |G|^2`` of each variant.

``--preset tiny`` (default): a 4-block GPT at seq 128, gbs 8 (docs/benchmarks.md, fourth session; AdamW is
now built as the engine builds it, without weight decay on biases and norms, which the fourth session's
run had). CPU, ten minutes::

    PYTHONPATH=src .venv/bin/python bench/noise_scale_variants.py

``--preset 125m``: GPT-125M as ``bench/time_to_target.py``'s bench preset trains it (shuffled samples, seq
512, dropout, bf16 on a GPU, AdamW as the engine builds it, the sqrt LR rule from gbs 8 to ``--gbs``, its
token-based warmup and cosine, clipping at 1), reported up to ~8M tokens at gbs 16: whether the
preconditioned noise scale is the larger one there, where the runs' own progress says the raw one
undervalues gbs 32; each from 64 micro-batch gradients, streamed (one gradient-sized sum is kept, not the
64). One GPU, ``data/bench`` carried, about two minutes::

    PYTHONPATH=src python3 bench/noise_scale_variants.py --preset 125m
"""

from __future__ import annotations

import argparse
import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

import ttt_plan
from cona.config import ModelConfig, TrainingConfig
from cona.data.indexed import IndexedDataset
from cona.engine.gns import is_tied
from cona.engine.model import GPT, init_weights, token_cross_entropy
from cona.engine.optim import LRSchedule, build_optimizer, set_lr
from cona.planner.efficiency import two_batch_estimate


@dataclass(frozen=True)
class Setup:
    """A model and how it is trained until the measurements."""

    model: ModelConfig
    gbs: int
    schedule_at_gbs: Callable[[int], LRSchedule]
    """The LR schedule at a gbs."""
    reports: str
    """Default ``--reports``: the steps to measure at."""
    k: int
    """Default ``--k``: micro-batch gradients per measurement."""


def _tiny_schedule(gbs: int) -> LRSchedule:  # 1e-3 at any gbs, warmup over 40 steps of gbs 8
    return LRSchedule(peak_lr=1e-3, min_lr=1e-3, warmup_tokens=40 * 8 * 128, decay_tokens=40 * 8 * 128)


def _bench_125m_schedule(gbs: int) -> LRSchedule:  # bench/ttt_plan.py's bench preset under the sqrt rule
    preset = ttt_plan.PRESETS["125m", "bench"]
    factor = math.sqrt(gbs / preset.base_gbs)
    return LRSchedule(
        peak_lr=preset.base_lr * factor, min_lr=preset.base_min_lr * factor,
        warmup_tokens=preset.warmup_tokens, decay_tokens=preset.total_tokens,
    )  # fmt: skip


SETUPS = {
    "tiny": Setup(
        ModelConfig(layers=4, hidden=256, heads=4, seq=128, vocab_size=50304, attention_dropout=0.0,
                    hidden_dropout=0.0),
        gbs=8, schedule_at_gbs=_tiny_schedule, reports="20,50,100,200", k=16,
    ),
    "125m": Setup(
        ModelConfig(layers=12, hidden=768, heads=12, seq=512, vocab_size=50304),
        gbs=16, schedule_at_gbs=_bench_125m_schedule, reports="30,60,120,240,480,720,960", k=64,
    ),
}  # fmt: skip
"""``--preset``. The tiny one is the fourth session's (no dropout, a flat LR after a short warmup); 125m
keeps the bench preset's dropout."""


class Windows:
    """The corpus's non-overlapping ``seq + 1``-token windows in a seeded random order, each used once.

    The engine's samples are shuffled over the corpus; read in corpus order, training walks from one
    source package to the next (the first GPU run did, 2026-12-05: single-batch losses of 5.8-7.8 at 1-6M
    tokens, where the bench runs' evaluation is at 3.5-4.6), and 64 consecutive micro-batches at a
    report come from one package, not from the distribution the noise scale is about."""

    def __init__(
        self, prefix: str, tokens_needed: int, seq: int, device: torch.device, seed: int = 0
    ) -> None:
        self.span, self.device = seq + 1, device
        dataset = IndexedDataset(prefix)
        self.stream = np.concatenate([dataset[index] for index in range(len(dataset))])
        windows = self.stream.size // self.span
        if windows * self.span < tokens_needed:
            raise SystemExit(
                f"{prefix}: {self.stream.size:,} tokens, fewer than the {tokens_needed:,} the reports need"
            )
        self.order, self.position = np.random.default_rng(seed).permutation(windows), 0

    def batch(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        starts = self.order[self.position : self.position + rows] * self.span
        self.position += rows
        chunk = np.stack([self.stream[start : start + self.span] for start in starts]).astype(np.int64)
        tokens = torch.from_numpy(chunk).to(self.device)
        return tokens[:, :-1], tokens[:, 1:]


def scaled_sqr(grads: list[torch.Tensor], scale: list[torch.Tensor | float]) -> float:
    """``sum |grad * scale|^2`` over the tensors (a scale of 0 leaves a tensor out)."""
    kept = [(g, s) for g, s in zip(grads, scale, strict=True) if not (isinstance(s, float) and s == 0.0)]
    return sum(((g * s) ** 2).sum().item() for g, s in kept)


class SmallBatchSums:
    """Streams ``k`` micro-batch gradients of ``m`` samples: each variant's mean ``|scaled g|^2`` and one sum
    of the raw gradients, so that ``k`` is not bounded by memory (one gradient-sized buffer)."""

    def __init__(self, variants: dict[str, list[torch.Tensor | float]]) -> None:
        self.variants = variants
        self.small = dict.fromkeys(variants, 0.0)
        self.total: list[torch.Tensor] | None = None
        self.count = 0

    def add(self, grads: list[torch.Tensor]) -> None:
        for name, scale in self.variants.items():
            self.small[name] += scaled_sqr(grads, scale)
        if self.total is None:
            self.total = [grad.clone() for grad in grads]
        else:
            torch._foreach_add_(self.total, grads)
        self.count += 1

    def b_simple(self, m: int) -> dict[str, float]:
        """Each variant's ``tr(Sigma) / |G|^2``."""
        assert self.total is not None, "no gradient added"
        mean = [grad / self.count for grad in self.total]
        out = {}
        for name, scale in self.variants.items():
            small, big = self.small[name] / self.count, scaled_sqr(mean, scale)
            grad_sqr, trace_sigma = two_batch_estimate(small, big, m, self.count * m)
            out[name] = float(trace_sigma / grad_sqr)
        return out


def b_simple(grads: list[list[torch.Tensor]], scale: list[torch.Tensor | float], m: int) -> float:
    """``tr(Sigma) / |G|^2`` from ``k`` gradients of ``m`` samples each, elements times ``scale``."""
    sums = SmallBatchSums({"one": scale})
    for gradient in grads:
        sums.add(gradient)
    return sums.b_simple(m)["one"]


def loss_of(model: GPT, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, targets = batch
    autocast = torch.autocast("cuda", torch.bfloat16) if inputs.is_cuda else contextlib.nullcontext()
    with autocast:
        return token_cross_entropy(model(inputs), targets)


def report(
    model: GPT, optimizer: torch.optim.Optimizer, windows: Windows, k: int, m: int
) -> dict[str, float]:
    named = list(model.named_parameters())
    group = optimizer.param_groups[0]
    (_, beta2), eps = group["betas"], group["eps"]
    step = float(optimizer.state[named[0][1]]["step"])
    precondition = [
        1.0 / ((optimizer.state[p]["exp_avg_sq"] / (1 - beta2**step)).sqrt() + eps) for _, p in named
    ]
    tied = [is_tied(name) for name, _ in named]  # left out (scale 0) as the engine leaves them out
    sums = SmallBatchSums({
        "raw": [0.0 if left_out else 1.0 for left_out in tied],
        "preconditioned": [0.0 if left_out else p for left_out, p in zip(tied, precondition, strict=True)],
        "raw, with the embedding": [1.0] * len(named),
    })  # fmt: skip
    for _ in range(k):
        model.zero_grad(set_to_none=True)
        loss_of(model, windows.batch(m)).backward()
        sums.add([p.grad.detach().float() for _, p in named])
    model.zero_grad(set_to_none=True)
    return sums.b_simple(m)


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(SETUPS), default="tiny")
    parser.add_argument("--data", default="data/bench/bench_text_document", help="indexed dataset prefix")
    parser.add_argument("--gbs", type=int, default=None, help="default: the preset's")
    parser.add_argument("--reports", default=None, help="steps to measure at (default: the preset's)")
    parser.add_argument("--k", type=int, default=None, help="micro-batch gradients a measurement (preset's)")
    parser.add_argument("--m", type=int, default=4, help="samples per micro-batch gradient")
    args = parser.parse_args()
    setup = SETUPS[args.preset]
    gbs, seq = args.gbs or setup.gbs, setup.model.seq
    reports = sorted(int(step) for step in (args.reports or setup.reports).split(","))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    k = args.k or setup.k
    needed = (reports[-1] * gbs + len(reports) * k * args.m) * (seq + 1)
    windows = Windows(args.data, needed, seq, device)
    torch.manual_seed(0)
    model = GPT(setup.model).to(device)
    init_weights(model, setup.model, 1)
    optimizer = build_optimizer([model], TrainingConfig())  # AdamW(0.9, 0.95, eps 1e-8), decay 0.1
    schedule = setup.schedule_at_gbs(gbs)
    print(f"{args.preset}: gbs {gbs}, seq {seq}, on {device}; {schedule}", flush=True)
    for step in range(1, reports[-1] + 1):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(model, windows.batch(gbs))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        set_lr(optimizer, schedule.lr_at(step * gbs * seq))
        optimizer.step()
        if step in reports:
            values = report(model, optimizer, windows, k, args.m)
            shown = ", ".join(f"{name} {value:.1f}" for name, value in values.items())
            tokens = step * gbs * seq / 1e6
            print(f"step {step} ({tokens:.2f}M tokens, loss {loss.item():.3f}): B_simple {shown}", flush=True)


if __name__ == "__main__":
    main()
