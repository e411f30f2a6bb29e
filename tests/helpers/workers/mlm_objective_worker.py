"""torchrun worker: BERT's loss normalisation under dp/tp/pp when micro-batches hold unequal masked counts.

Usage: torchrun --nproc-per-node N tests/helpers/workers/mlm_objective_worker.py LAYOUT [LAYOUT ...]
A layout is ``name:key=value,...`` over Strategy fields (mbs, gbs, dp, tp, pp, zero_stage). Every rank
computes the 1-process reference itself; rank 0 prints one JSON line per layout, prefixed ``MLM``. The
helpers are also used in-process by test_mlm_objective.py.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from cona.config import ConaConfig, ModelConfig, TrainingConfig
from cona.engine.gns import is_tied
from cona.engine.model import GPT, IGNORE_INDEX, init_weights, token_cross_entropy
from cona.engine.objective import summed_token_cross_entropy
from cona.engine.parallel_dims import build_mesh
from cona.engine.train_model import TrainingModel, build_training_model
from cona.strategy import Strategy

TARGETS_PER_ROW = (1, 6, 3, 0)
"""Masked positions of each row: unequal, one row without any (its micro-batch may have no loss token)."""


def tiny_bert_config() -> ConaConfig:
    model = ModelConfig(
        family="bert",
        layers=2,
        hidden=32,
        heads=2,
        seq=16,
        vocab_size=64,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )
    return ConaConfig(model=model, training=TrainingConfig(device="cpu", dtype="fp32", seed=5))


def masked_batch(config: ConaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of random tokens whose targets are IGNORE_INDEX except at TARGETS_PER_ROW[r] positions."""
    generator = torch.Generator().manual_seed(4)
    shape = (len(TARGETS_PER_ROW), config.model.seq)
    inputs = torch.randint(0, config.model.vocab_size, shape, generator=generator)
    originals = torch.randint(0, config.model.vocab_size, shape, generator=generator)
    rank = torch.rand(shape, generator=generator).argsort(dim=1).argsort(dim=1)
    chosen = rank < torch.tensor(TARGETS_PER_ROW).unsqueeze(1)
    return inputs, torch.where(chosen, originals, torch.full_like(originals, IGNORE_INDEX))


def reference(config: ConaConfig, inputs: torch.Tensor, targets: torch.Tensor, n_small: int) -> dict:
    """Global masked mean, its gradients, and the GNS small norm (mean over the n_small row groups of
    |grad of n_small * S_k / N|^2, without the tied matrix) of the plain model on the whole batch."""
    model = GPT(config.model)
    init_weights(model, config.model, config.training.runtime.seed)
    total = (targets != IGNORE_INDEX).sum()
    small_sqr = []
    for rows in torch.arange(inputs.shape[0]).chunk(n_small):
        model.zero_grad()
        (summed_token_cross_entropy(model(inputs[rows]), targets[rows]) * n_small / total).backward()
        small_sqr.append(_gns_sqr(model))
    model.zero_grad()
    loss = token_cross_entropy(model(inputs), targets)
    loss.backward()
    with torch.no_grad():
        means = [token_cross_entropy(model(inputs[[r]]), targets[[r]]) for r in range(inputs.shape[0])]
    return {
        "loss": loss.item(),
        "grads": {name: p.grad.clone() for name, p in model.named_parameters()},
        "small_sqr": sum(small_sqr) / n_small,
        "mean_of_row_means": torch.stack([m for m in means if not m.isnan()]).mean().item(),
    }


def _gns_sqr(model: GPT) -> float:
    return sum(p.grad.square().sum().item() for name, p in model.named_parameters() if not is_tied(name))


def micro_batches_of(strategy: Strategy, dp_rank: int, inputs: torch.Tensor, targets: torch.Tensor) -> list:
    """Micro-batch k of dp rank r holds rows [(k*dp + r)*mbs, +mbs) (the trainer's sample order)."""
    starts = [(k * strategy.dp + dp_rank) * strategy.mbs for k in range(strategy.micro_batches)]
    return [(inputs[s : s + strategy.mbs], targets[s : s + strategy.mbs]) for s in starts]


def max_grad_diff(engine: TrainingModel, ref_grads: dict) -> float:
    worst = 0.0
    for part in engine.model_parts:
        for name, param in part.named_parameters():
            grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
            worst = max(worst, (grad - ref_grads[name]).abs().max().item())
    return worst


def run_layout(strategy: Strategy, config: ConaConfig) -> dict:
    """One step under ``strategy`` against the reference; collective over every rank of the layout."""
    inputs, targets = masked_batch(config)
    mesh = build_mesh(strategy, "cpu")
    engine = build_training_model(config, strategy, mesh, torch.device("cpu"))
    micro = micro_batches_of(strategy, mesh.get_local_rank("dp"), inputs, targets)
    out = engine.train_step_pending(micro).result()
    # The engine's small batches: micro-batches, or a measured step's pieces of a single one per rank.
    n_small = strategy.gbs // out.gns_small_batch
    ref = reference(config, inputs, targets, n_small)
    diff = torch.tensor(max_grad_diff(engine, ref["grads"]))
    if dist.is_initialized():
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return {
        "loss": out.loss,
        "eval_loss": engine.eval_loss(micro),
        "ref_loss": ref["loss"],
        "mean_of_row_means": ref["mean_of_row_means"],
        "max_grad_diff": diff.item(),
        "gns_small_sqr": out.gns_small_sqr,
        # One gradient per step (n_small 1): the difference estimator has no estimate on a first step.
        "ref_small_sqr": ref["small_sqr"] if n_small > 1 else None,
    }


def parse_layout(text: str) -> tuple[str, Strategy]:
    name, _, spec = text.partition(":")
    fields: dict = {"dp": 1, "tp": 1, "pp": 1, "mbs": 1, "gbs": len(TARGETS_PER_ROW)}
    for item in filter(None, spec.split(",")):
        key, value = item.split("=")
        fields[key] = int(value)
    return name, Strategy(**fields)


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    config = tiny_bert_config()
    for text in sys.argv[1:]:
        name, strategy = parse_layout(text)
        result = run_layout(strategy, config)
        if dist.get_rank() == 0:
            print("MLM " + json.dumps({"layout": name, **result}), flush=True)
    sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # skip interpreter teardown: gloo threads can abort it (as cona.engine.worker does)


if __name__ == "__main__":
    main()
