"""How a step runs on this device under this strategy: what is compiled, CUDA graphs, precision.

Pure decisions over the config and strategy, shared by the training model and the benchmarks.

Every compiled graph has static shapes: one graph per micro-batch size (and per piece size of a measured
step), kept for the rest of the session, so an in-place switch back to an earlier size compiles nothing. A
dynamic batch dimension would serve every size with one graph, but its kernels are tuned for no size and
inductor then cannot fuse a norm's row and column reductions, which costs more per step than a compile
per size costs once (the persistent compile caches of :mod:`cona.engine.compile_cache` make a size
compiled before load in seconds).
"""

from __future__ import annotations

from typing import Literal

import torch

from cona.config import ModelConfig, TrainingConfig
from cona.planner.flops import parameter_count
from cona.strategy import Strategy

CompileScope = Literal["model", "blocks", "none"]

BLOCKS_FROM_PARAMETERS = 300_000_000
"""Under ``training.compile_scope = "auto"`` a model of at least this many parameters compiles each block
(regional compilation) rather than the whole model. One block's graph compiles in a few seconds and serves
every block, where the whole model's takes 20-40 s; the cost is the code between blocks (embedding, final
norm, head, loss) running eager, which matters only where the host bounds the step, i.e. in small models."""

DYNAMO_RECOMPILE_LIMIT = 64
"""Graphs dynamo keeps per compiled function: one per micro-batch and piece size a session has run (its
default of 8 would fall back to eager after a few in-place switches)."""


def compiles_whole_model(strategy: Strategy) -> bool:
    """Whether the whole model with its loss can be one graph: neither split (tp, pp) nor sharded (FSDP)."""
    return strategy.tp == 1 and strategy.pp == 1 and (strategy.dp == 1 or strategy.zero_stage == 0)


def compile_scope(
    training: TrainingConfig, model: ModelConfig, strategy: Strategy, device_type: str
) -> CompileScope:
    """What ``torch.compile`` covers: ``model`` (one graph with the loss), ``blocks`` (each transformer
    block; the rest eager) or ``none``. ``training.compile_scope`` picks it; ``auto`` compiles the whole
    model where it can and the model is smaller than :data:`BLOCKS_FROM_PARAMETERS`."""
    if not training.runtime.compiles_on(device_type):
        return "none"
    if not compiles_whole_model(strategy):
        return "blocks"
    if training.runtime.compile_scope != "auto":
        return training.runtime.compile_scope
    return "blocks" if parameter_count(model) >= BLOCKS_FROM_PARAMETERS else "model"


def uses_cuda_graphs(
    training: TrainingConfig, model: ModelConfig, strategy: Strategy, device: torch.device
) -> bool:
    """``training.cuda_graphs`` applies where the whole model is compiled on a GPU and a step runs one
    micro-batch: with several, autograd accumulates into gradients that the next replay of the same backward
    graph would overwrite first. A measured step's pieces hold their gradients apart for that reason."""
    return (
        training.runtime.cuda_graphs
        and device.type == "cuda"
        and compile_scope(training, model, strategy, device.type) == "model"
        and strategy.micro_batches == 1
    )


def compile_options(cuda_graphs: bool) -> dict[str, bool]:
    """Inductor's options for the whole-model compile: CUDA graphs where they apply (what mode
    "reduce-overhead" sets)."""
    return {"triton.cudagraphs": cuda_graphs}


def resolved_dtype(training: TrainingConfig, device: torch.device) -> str:
    """The precision a run trains in: fp32 on CPU, ``training.dtype`` on CUDA."""
    return training.runtime.dtype if device.type == "cuda" else "fp32"
