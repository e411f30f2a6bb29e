"""``B_simple`` of a small GPT three ways: raw gradients, Adam-preconditioned ones, and with the embedding.

The engine measures the noise scale on the raw gradients of every parameter but the embedding/LM-head
matrix (:mod:`cona.engine.gns`). AdaptDL's Adam variant divides each gradient element by Adam's
bias-corrected ``sqrt(v) + eps`` first. This trains a 4-block GPT with AdamW on the bench corpus and, at a few
steps, takes ``k`` micro-batch gradients of ``m`` samples at fixed parameters and prints the unbiased
``B_simple = tr(Sigma) / |G|^2`` of each variant (docs/benchmarks.md, fourth session). CPU, ten minutes::

    PYTHONPATH=src .venv/bin/python bench/noise_scale_variants.py
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from cona.config import ModelConfig
from cona.data.indexed import IndexedDataset
from cona.engine.gns import is_tied
from cona.engine.model import GPT, init_weights, token_cross_entropy
from cona.planner.efficiency import two_batch_estimate

MODEL = ModelConfig(
    layers=4, hidden=256, heads=4, seq=128, vocab_size=50304, attention_dropout=0.0, hidden_dropout=0.0
)
BETA2, EPS, LR, WARMUP_STEPS = 0.95, 1e-8, 1e-3, 40


class Windows:
    """Consecutive ``seq + 1``-token windows from the start of the corpus, each used once."""

    def __init__(self, prefix: str, tokens_needed: int) -> None:
        dataset, parts, count = IndexedDataset(prefix), [], 0
        for index in range(len(dataset)):
            parts.append(dataset[index].astype(np.int64))
            count += parts[-1].size
            if count >= tokens_needed:
                break
        self.stream, self.position = np.concatenate(parts), 0

    def batch(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        span = MODEL.seq + 1
        chunk = self.stream[self.position : self.position + rows * span]
        self.position += rows * span
        tokens = torch.from_numpy(chunk.reshape(rows, span))
        return tokens[:, :-1], tokens[:, 1:]


def b_simple(grads: list[list[torch.Tensor]], scale: list[torch.Tensor | float], m: int) -> float:
    """``tr(Sigma) / |G|^2`` from ``k`` gradients of ``m`` samples each, elements times ``scale``."""
    k = len(grads)
    small = np.mean(
        [sum(((g * s) ** 2).sum().item() for g, s in zip(gs, scale, strict=True)) for gs in grads]
    )
    mean = [sum(gs[i] for gs in grads) / k for i in range(len(scale))]
    big = sum(((g * s) ** 2).sum().item() for g, s in zip(mean, scale, strict=True))
    grad_sqr, trace_sigma = two_batch_estimate(small, big, m, k * m)
    return float(trace_sigma / grad_sqr)


def report(
    model: GPT, optimizer: torch.optim.Optimizer, windows: Windows, k: int, m: int
) -> dict[str, float]:
    named = list(model.named_parameters())
    grads = []
    for _ in range(k):
        model.zero_grad(set_to_none=True)
        inputs, targets = windows.batch(m)
        token_cross_entropy(model(inputs), targets).backward()
        grads.append([p.grad.detach().clone() for _, p in named])
    step = optimizer.state[named[0][1]]["step"].item()
    precondition = [
        1.0 / ((optimizer.state[p]["exp_avg_sq"] / (1 - BETA2**step)).sqrt() + EPS) for _, p in named
    ]
    without = [not is_tied(name) for name, _ in named]

    def pick(values: list) -> list:
        return [value for value, keep in zip(values, without, strict=True) if keep]

    kept = [pick(gs) for gs in grads]
    return {
        "raw": b_simple(kept, [1.0] * len(kept[0]), m),
        "preconditioned": b_simple(kept, pick(precondition), m),
        "raw, with the embedding": b_simple(grads, [1.0] * len(named), m),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="data/bench/bench_text_document", help="indexed dataset prefix")
    parser.add_argument("--gbs", type=int, default=8)
    parser.add_argument("--reports", default="20,50,100,200", help="steps to measure at")
    parser.add_argument("--k", type=int, default=16, help="micro-batch gradients per measurement")
    parser.add_argument("--m", type=int, default=4, help="samples per micro-batch gradient")
    args = parser.parse_args()
    reports = sorted(int(step) for step in args.reports.split(","))
    needed = (reports[-1] * args.gbs + len(reports) * args.k * args.m) * (MODEL.seq + 1)
    windows = Windows(args.data, needed)
    torch.manual_seed(0)
    model = GPT(MODEL)
    init_weights(model, MODEL, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, BETA2), eps=EPS, weight_decay=0.1)
    for step in range(1, reports[-1] + 1):
        inputs, targets = windows.batch(args.gbs)
        optimizer.zero_grad(set_to_none=True)
        loss = token_cross_entropy(model(inputs), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for group in optimizer.param_groups:
            group["lr"] = LR * min(1.0, step / WARMUP_STEPS)
        optimizer.step()
        if step in reports:
            values = report(model, optimizer, windows, args.k, args.m)
            shown = ", ".join(f"{name} {value:.1f}" for name, value in values.items())
            print(f"step {step} (loss {loss.item():.3f}): B_simple {shown}", flush=True)


if __name__ == "__main__":
    main()
