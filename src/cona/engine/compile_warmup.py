"""Compile the graphs of micro-batch sizes a stage may switch to in place, in a helper process.

An in-place switch to a micro-batch size the session has not run needs the graph of that shape (every graph
has static shapes, :mod:`cona.engine.step_modes`). Compiled in the training process at the switch, it would
stop training for the whole compile (tens of seconds for a whole model). Instead, while the stage trains, one
helper process per node builds the same model on the same device and runs one forward and backward at each
size the stage lists (:attr:`cona.engine.spec.StageSpec.warm_micro_batches`) and at the pieces of its
measured steps: inductor's and AOTAutograd's on-disk caches (:mod:`cona.engine.compile_cache`) then hold the
compiled code, and the training process's compile at the switch is dynamo's trace and a cache load.

The helper builds a one-rank copy (dp = tp = pp = 1) with random tokens and no optimizer: the compiled
forward and backward of a rank do not depend on the data-parallel degree where the whole model or its
blocks are compiled unsharded. Split or sharded layouts (tp, pp, FSDP) are not warmed.

    python -m cona.engine.compile_warmup SPEC.json
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from cona.config import ConaConfig
from cona.engine.spec import StageSpec
from cona.strategy import Strategy, noise_step_pieces

WARMUP_LOG = "compile_warmup.log"
"""The helper's output, in the stage directory."""
WARMUP_SPEC = "compile_warmup_spec.json"
"""The stage spec the helper reads, in the stage directory."""
TORCHRUN_VARIABLES = frozenset(
    {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE"}
    | {"GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
)
"""torchrun's variables, which the helper (a one-rank group of its own) must not inherit."""


def warmable(spec: StageSpec) -> bool:
    """Whether the stage compiles graphs the one-rank helper can build: compiled, unsplit, unsharded."""
    strategy, training = spec.strategy, spec.config.training
    unsplit = strategy.tp == 1 and strategy.pp == 1 and (strategy.dp == 1 or strategy.zero_stage == 0)
    return bool(spec.warm_micro_batches) and unsplit and training.runtime.compile is not False


def start_compile_warmup(spec: StageSpec, device: torch.device) -> subprocess.Popen | None:
    """On the first local rank of a GPU node, start the helper for ``spec``'s warm sizes (None elsewhere,
    or where nothing is to be warmed). It runs beside training and exits when done; its output goes to
    :data:`WARMUP_LOG` in the stage directory."""
    if device.type != "cuda" or int(os.environ.get("LOCAL_RANK", "0")) != 0 or not warmable(spec):
        return None
    spec_path = spec.write(spec.stage_dir / WARMUP_SPEC)
    log = open(spec.stage_dir / WARMUP_LOG, "ab")  # noqa: SIM115 (handed to the child)
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in TORCHRUN_VARIABLES and not key.startswith("TORCHELASTIC_")
    }
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[device.index] if visible else str(device.index)
    command = [sys.executable, "-m", "cona.engine.compile_warmup", str(spec_path)]
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)


def warm_strategies(strategy: Strategy, sizes: tuple[int, ...]) -> list[Strategy]:
    """One-rank strategies of each warm size other than the stage's own, one micro-batch a step (the shape
    of an unsplit step; a measured step's pieces are compiled by the same step)."""
    base = dataclasses.replace(strategy, dp=1, tp=1, pp=1)
    return [dataclasses.replace(base, mbs=mbs, gbs=mbs) for mbs in sorted(set(sizes) - {strategy.mbs})]


def compile_shapes(
    config: ConaConfig, strategy: Strategy, sizes: tuple[int, ...], device: torch.device
) -> list[dict[str, float]]:
    """Build a one-rank model per warm size and run an unmeasured and a measured step (the whole
    micro-batch and its pieces, as the trainer's steps run them) on random tokens; returns the seconds
    each size took."""
    from cona.engine.parallel_dims import build_mesh
    from cona.engine.train_model import build_training_model

    timings = []
    for shape in warm_strategies(strategy, sizes):
        began = time.perf_counter()
        model = build_training_model(config, shape, build_mesh(shape, device.type), device)
        tokens = torch.randint(0, config.model.vocab_size, (shape.mbs, config.model.seq + 1))
        batch = [(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())]
        for measure in (False, True) if noise_step_pieces(shape) > 1 else (False,):
            model.train_step_pending(batch, measure_gns=measure).result()
            model.drop_gradients()
        del model
        timings.append({"mbs": shape.mbs, "seconds": round(time.perf_counter() - began, 2)})
        print(f"compiled mbs {shape.mbs} in {timings[-1]['seconds']} s", flush=True)
    return timings


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    spec = StageSpec.read(Path(args[0]))
    use_cuda = torch.cuda.is_available() and spec.config.training.runtime.device != "cpu"
    device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    store = dist.HashStore()
    dist.init_process_group("nccl" if use_cuda else "gloo", store=store, rank=0, world_size=1)
    try:
        compile_shapes(spec.config, spec.strategy, spec.warm_micro_batches, device)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
