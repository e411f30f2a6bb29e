"""What an in-place switch of the micro-batch size costs a compiled model: the first step at the new shape.

For each way of marking the batch dimension (``maybe``: ``torch._dynamo.maybe_mark_dynamic``;
``strict``: ``torch._dynamo.mark_dynamic``, what the engine does; ``none``: static shapes, dynamo's
automatic dynamic after a second shape), one process builds CONA's training model (whole-model compile,
CUDA graphs) at mbs 8, takes steps, then :meth:`TrainingModel.rebatch` to mbs 16 and 32 as an in-place
switch does, and prints the first step's seconds and the steady step time at each shape, with dynamo's
count of compiled graphs. ``VARIANT+mixorder`` leaves inductor's mix-order reductions on (torch's default;
the engine turns them off, see :func:`cona.engine.step_modes.compile_options`)::

    PYTHONPATH=src python3 bench/rebatch_compile.py --size 125m --seq 512
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from cona.engine import train_model
from cona.engine.step_modes import compile_options
from cona.strategy import Strategy
from engine_vs_ref import engine_model, init_single_process_group, random_batch, synchronize

WARM_STEPS = 3
"""Untimed steps after the first at a shape: CUDA graph trees warm up and record a new shape's graph there."""


def timed_steps(model, optimizer, batch, steps: int) -> tuple[float, float]:
    """(first step s, mean in ms of ``steps`` steps after :data:`WARM_STEPS` more)."""

    def step() -> None:
        model.train_step_pending([batch], measure_gns=False)
        model.optimizer_step_pending(optimizer)
        optimizer.zero_grad(set_to_none=True)

    began = time.perf_counter()
    step()
    synchronize("cuda")
    first = time.perf_counter() - began
    for _ in range(WARM_STEPS):
        step()
    synchronize("cuda")
    began = time.perf_counter()
    for _ in range(steps):
        step()
    synchronize("cuda")
    return first, (time.perf_counter() - began) / steps * 1e3


def mix_order_options(cuda_graphs: bool) -> dict[str, bool]:
    """The engine's compile options with inductor's mix-order reductions left on (torch's default)."""
    return {**compile_options(cuda_graphs), "triton.mix_order_reduction": True}


def run_variant(variant: str, args: argparse.Namespace) -> dict:
    torch._dynamo.reset()
    original = torch._dynamo.mark_dynamic  # what the engine calls on each batch
    marks = {"maybe": torch._dynamo.maybe_mark_dynamic, "strict": original, "none": lambda tensor, dim: None}
    marking, _, mix = variant.partition("+")
    torch._dynamo.mark_dynamic = marks[marking]
    train_model.compile_options = mix_order_options if mix == "mixorder" else compile_options
    try:
        model, optimizer, _ = engine_model(args.size, args.mbs[0], args)
        row = {"variant": variant}
        for mbs in args.mbs:
            if mbs != model.strategy.mbs:
                model.rebatch(Strategy(dp=1, tp=1, pp=1, mbs=mbs, gbs=mbs, zero_stage=0))
            first, step_ms = timed_steps(model, optimizer, random_batch(args.size, mbs, args.seq, "cuda"), 20)
            graphs = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
            row[f"mbs{mbs}"] = {
                "first_step_s": round(first, 2),
                "step_ms": round(step_ms, 2),
                "graphs": graphs,
            }
        row["graphs"] = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    except Exception as err:  # noqa: BLE001 (a variant that cannot compile is a result)
        row = {"variant": variant, "error": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"}
    finally:
        torch._dynamo.mark_dynamic = original
        train_model.compile_options = compile_options
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="125m")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--mbs", default="8,16,32")
    parser.add_argument("--variants", default="maybe,strict,none")
    args = parser.parse_args()
    args.mbs = [int(m) for m in args.mbs.split(",")]
    args.device, args.no_compile = "cuda", False
    init_single_process_group("cuda")
    for variant in args.variants.split(","):
        run_variant(variant, args)


if __name__ == "__main__":
    main()
