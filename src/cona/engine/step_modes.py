"""How a step runs on this device under this strategy: whole-model compile, CUDA graphs, precision.

Pure decisions over the config and strategy, shared by the training model and the benchmarks.
"""

from __future__ import annotations

import torch
import torch._inductor.config  # noqa: F401 (compile_options reads it)

from cona.config import TrainingConfig
from cona.strategy import Strategy


def compiles_whole_model(strategy: Strategy) -> bool:
    """``training.compile`` compiles the whole model with its loss in one graph (as the single-GPU
    reference does) where the model is neither split nor sharded, and each block otherwise."""
    return strategy.tp == 1 and strategy.pp == 1 and (strategy.dp == 1 or strategy.zero_stage == 0)


def uses_cuda_graphs(training: TrainingConfig, strategy: Strategy, device: torch.device) -> bool:
    """``training.cuda_graphs`` applies where the whole model is compiled on a GPU and a step runs one
    micro-batch: with several, autograd accumulates into gradients that the next replay of the same backward
    graph would overwrite first. A measured step's pieces hold their gradients apart for that reason."""
    return (
        training.cuda_graphs
        and training.compiles_on(device.type)
        and device.type == "cuda"
        and compiles_whole_model(strategy)
        and strategy.micro_batches == 1
    )


def compile_options(cuda_graphs: bool) -> dict[str, bool]:
    """Inductor's options for the whole-model compile: CUDA graphs where they apply (what mode
    "reduce-overhead" sets), and no mix-order reductions. Inductor fuses a LayerNorm backward's row and
    column reductions only above 5 Mi elements, and that test guards the batch size: GPT-125M at seq 512
    compiled for mbs 8 compiled again at the first mbs above 13 (19-31 s on the H200,
    bench/rebatch_compile.py), so an in-place switch of mbs paid a recompile despite the dynamic batch."""
    options = {"triton.cudagraphs": cuda_graphs}
    if hasattr(torch._inductor.config.triton, "mix_order_reduction"):  # torch >= 2.10
        options["triton.mix_order_reduction"] = False
    return options


def resolved_dtype(training: TrainingConfig, device: torch.device) -> str:
    """The precision a run trains in: fp32 on CPU, ``training.dtype`` on CUDA."""
    return training.dtype if device.type == "cuda" else "fp32"
