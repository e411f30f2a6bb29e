"""torchrun worker: one training step of a tiny GPT under each requested layout vs the 1-process reference.

Usage: torchrun --nproc-per-node N tests/helpers/workers/parity_worker.py [family=F] LAYOUT [LAYOUT ...]
[family=F LAYOUT ...]
A layout is ``name:key=value,...`` over Strategy fields, e.g. ``dp2xtp2:dp=2,tp=2,zero_stage=3``. The model
family F is gpt (default), llama (grouped-query attention with 2 of 4 heads, untied head) or bert (targets
only at some positions, the others IGNORE_INDEX, the same number per row); ``family=F`` applies to the
layouts after it, up to the next one (one launch serves several families). Every rank computes the
reference itself (plain model, no mesh, whole global batch). Rank 0 prints one JSON line per layout,
prefixed ``PARITY``, with its family.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from cona.config import ConaConfig, ModelConfig, TrainingConfig
from cona.engine.gns import is_tied
from cona.engine.model import GPT, IGNORE_INDEX, init_weights
from cona.engine.parallel_dims import build_mesh
from cona.engine.train_model import build_training_model, token_cross_entropy
from cona.strategy import Strategy

MBS, GBS = 2, 8
"""Defaults; a layout may set a smaller gbs (the first gbs samples of the batch are used)."""
PROBE_ROWS = 3  # not a multiple of mbs: exercises probe_loss's repetition
FAMILY_KEYS = {"gpt": {}, "llama": {"kv_heads": 2, "tie_embeddings": False}, "bert": {}}
BERT_TARGETS_PER_ROW = 5
"""Equal counts per row keep the global mean over targets equal to the mean of micro-batch means."""


def tiny_config(family: str = "gpt") -> ConaConfig:
    model = ModelConfig(
        family=family,
        layers=4,
        hidden=64,
        heads=4,
        seq=32,
        vocab_size=256,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        **FAMILY_KEYS[family],
    )
    return ConaConfig(model=model, training=TrainingConfig(device="cpu", dtype="fp32", seed=7))


def global_batch(config: ConaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, config.model.vocab_size, (GBS, config.model.seq + 1), generator=generator)
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    if config.model.family == "bert":
        ignored = torch.rand(targets.shape, generator=generator).argsort(dim=1) >= BERT_TARGETS_PER_ROW
        targets[ignored] = IGNORE_INDEX
    return inputs, targets


def reference(config: ConaConfig, inputs: torch.Tensor, targets: torch.Tensor, n_small: int) -> dict:
    """Loss, grad norm, per-parameter grads and GNS inputs of the plain model on the whole batch."""
    model = GPT(config.model)
    init_weights(model, config.model, config.training.runtime.seed)
    small_sqr = []
    small = inputs.shape[0] // n_small
    for rows in torch.arange(inputs.shape[0]).split(small):
        model.zero_grad()
        token_cross_entropy(model(inputs[rows]), targets[rows]).backward()
        small_sqr.append(_gns_sqr(model))
    model.zero_grad()
    loss = token_cross_entropy(model(inputs), targets)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()])).item()
    with torch.no_grad():
        probe = token_cross_entropy(model(inputs[:PROBE_ROWS]), targets[:PROBE_ROWS]).item()
    return {
        "probe_loss": probe,
        "loss": loss.item(),
        "norm": norm,
        "grads": grads,
        "big_sqr": _gns_sqr(model),
        "small_sqr": sum(small_sqr) / len(small_sqr),
    }


def _gns_sqr(model: GPT) -> float:
    return sum(p.grad.square().sum().item() for name, p in model.named_parameters() if not is_tied(name))


def parse_layout(text: str) -> tuple[str, Strategy]:
    name, _, spec = text.partition(":")
    fields: dict = {"dp": 1, "tp": 1, "pp": 1, "mbs": MBS, "gbs": GBS}
    for item in filter(None, spec.split(",")):
        key, value = item.split("=")
        if key in ("pipeline_schedule", "recompute"):
            fields[key] = value
        elif key == "sequence_parallel":
            fields[key] = value == "1"
        else:
            fields[key] = int(value)
    return name, Strategy(**fields)


def my_micro_batches(strategy: Strategy, dp_rank: int, inputs, targets) -> list:
    """Micro-batch k of dp rank r holds samples [(k*dp + r)*mbs, +mbs)."""
    out = []
    for k in range(strategy.micro_batches):
        start = (k * strategy.dp + dp_rank) * strategy.mbs
        out.append((inputs[start : start + strategy.mbs], targets[start : start + strategy.mbs]))
    return out


def max_grad_diff(model_parts, ref_grads: dict) -> float:
    """Largest |grad - reference| over this rank's parameters (full tensors gathered over their mesh)."""
    worst = 0.0
    for part in model_parts:
        for name, param in part.named_parameters():
            grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
            worst = max(worst, (grad - ref_grads[name]).abs().max().item())
    return worst


def run_layout(name: str, strategy: Strategy, config: ConaConfig, batch) -> dict:
    batch = tuple(t[: strategy.gbs] for t in batch)
    mesh = build_mesh(strategy, "cpu")
    model = build_training_model(config, strategy, mesh, torch.device("cpu"))
    micro = my_micro_batches(strategy, mesh.get_local_rank("dp"), *batch)
    start = time.perf_counter()
    out = model.train_step_pending(micro).result()
    norm = model.clip_grad_norm_pending(0.0).item()
    step_s = time.perf_counter() - start
    n_small = strategy.gbs // out.gns_small_batch
    ref = reference(config, *batch, n_small)
    diff = torch.tensor(max_grad_diff(model.model_parts, ref["grads"]))
    eval_loss = model.eval_loss(micro)
    probe_loss = model.probe_loss(batch[0][:PROBE_ROWS], batch[1][:PROBE_ROWS])
    # Evaluation must leave the step's gradients alone, and training must go on after it.
    diff = torch.maximum(diff, torch.tensor(max_grad_diff(model.model_parts, ref["grads"])))
    again = model.train_step_pending(micro).result()
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return {
        "layout": name,
        "loss": out.loss,
        "ref_loss": ref["loss"],
        "norm": norm,
        "ref_norm": ref["norm"],
        "gns_small_sqr": out.gns_small_sqr,
        "gns_small_batch": out.gns_small_batch,
        "ref_small_sqr": ref["small_sqr"],
        "gns_big_sqr": out.gns_big_sqr,
        "ref_big_sqr": ref["big_sqr"],
        "max_grad_diff": diff.item(),
        "step_s": round(step_s, 3),
        "eval_loss": eval_loss,
        "loss_after_eval": again.loss,
        "gns_small_sqr_after_eval": again.gns_small_sqr,
        "probe_loss": probe_loss,
        "ref_probe_loss": ref["probe_loss"],
    }


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    family, config, batch = None, None, None
    for text in sys.argv[1:] if sys.argv[1].startswith("family=") else ["family=gpt", *sys.argv[1:]]:
        if text.startswith("family="):
            family = text.removeprefix("family=")
            config = tiny_config(family)
            batch = global_batch(config)
            continue
        name, strategy = parse_layout(text)
        result = run_layout(name, strategy, config, batch)
        if dist.get_rank() == 0:
            print("PARITY " + json.dumps({"family": family, **result}), flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # skip interpreter teardown: gloo threads can abort it (as cona.engine.worker does)


if __name__ == "__main__":
    main()
