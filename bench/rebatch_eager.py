"""Why an eager run's first metrics line after an in-place switch to a new mbs is slow (issue 16).

One process builds CONA's training model eager (no compile) at the first mbs, then goes through the mbs
sequence the way an online run's in-place switches do (:meth:`TrainingModel.rebatch`). At each shape it
times every step of the first ``--line`` steps, the last of them measured (the gradient-noise step, run as
two halves, as before each metrics line), with the device synchronised after each step, then the mean of
``--steady`` steps more. With each step it prints what the CUDA caching allocator did in it: device
allocations (``cudaMalloc``), frees of cached blocks to retry one, and the reserved memory. Run once per
allocator setting, each in its own process (the setting is read when CUDA starts)::

    PYTHONPATH=src python3 bench/rebatch_eager.py --size 125m --seq 512
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=src python3 bench/rebatch_eager.py
    CUDA_MODULE_LOADING=EAGER PYTHONPATH=src python3 bench/rebatch_eager.py   # kernels loaded at CUDA start
    PYTHONPATH=src python3 bench/rebatch_eager.py --profile   # first two steps at each shape, profiled
    PYTHONPATH=src python3 bench/rebatch_eager.py --attention flash   # no cuDNN attention
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import torch

from engine_vs_ref import engine_model, init_single_process_group, random_batch, synchronize

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke run of the script
ALLOCATOR_COUNTS = ("num_device_alloc", "num_device_free", "num_alloc_retries")
PROFILE_TOP = 12
_BACKENDS = torch.nn.attention.SDPBackend
ATTENTION = {  # the H200's profile: cuDNN attention builds a plan at each new shape (~60-75 ms a pass)
    "default": [_BACKENDS.CUDNN_ATTENTION, _BACKENDS.FLASH_ATTENTION, _BACKENDS.EFFICIENT_ATTENTION,
                _BACKENDS.MATH],
    "flash": [_BACKENDS.FLASH_ATTENTION, _BACKENDS.MATH],  # MATH: the CPU smoke run has no flash kernel
}  # fmt: skip


def allocator_counts() -> dict[str, float]:
    stats = torch.cuda.memory_stats() if torch.cuda.is_available() else {}
    counts = {name: stats.get(name, 0) for name in ALLOCATOR_COUNTS}
    counts["reserved_gib"] = stats.get("reserved_bytes.all.current", 0) / 2**30
    return counts


def timed_step(model, optimizer, batch, *, measure: bool) -> dict:
    """One training step's wall seconds (device synchronised) and the allocator's activity in it."""
    before = allocator_counts()
    began = time.perf_counter()
    model.train_step_pending([batch], measure_gns=measure)
    model.optimizer_step_pending(optimizer)
    synchronize(DEVICE)
    seconds = time.perf_counter() - began
    after = allocator_counts()
    row = {"ms": round(seconds * 1e3, 1), "measured": measure}
    row.update({name: int(after[name] - before[name]) for name in ALLOCATOR_COUNTS})
    row["reserved_gib"] = round(after["reserved_gib"], 2)
    return row


def profiled_step(model, optimizer, batch) -> list[dict]:
    """One step under torch.profiler: the ops with the most host time of their own (where a first step at
    a new shape spends what the steps after it do not)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profile:
        timed_step(model, optimizer, batch, measure=False)
    events = sorted(profile.key_averages(), key=lambda e: -e.self_cpu_time_total)[:PROFILE_TOP]
    return [
        {"op": e.key, "calls": e.count, "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 2)} for e in events
    ]


def shape_rows(model, optimizer, mbs: int, args: argparse.Namespace) -> dict:
    batch = random_batch(args.size, mbs, args.seq, DEVICE)
    first = profiled_step(model, optimizer, batch) if args.profile else None
    again = profiled_step(model, optimizer, batch) if args.profile else None
    line = [timed_step(model, optimizer, batch, measure=i == args.line - 1) for i in range(args.line)]
    began = time.perf_counter()
    for _ in range(args.steady):
        model.train_step_pending([batch], measure_gns=False)
        model.optimizer_step_pending(optimizer)
    synchronize(DEVICE)
    steady_ms = (time.perf_counter() - began) / args.steady * 1e3
    line_ms = sum(step["ms"] for step in line)
    return {
        "mbs": mbs,
        "line_ms": round(line_ms, 1),
        "line_over_steady": round(line_ms / (steady_ms * args.line), 3),
        "steady_ms": round(steady_ms, 2),
        "steps": line,
        **({"profile_first": first, "profile_second": again} if args.profile else {}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="125m")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--mbs", default="8,16,32,16,32,64,32", help="the shapes in order (an online run's)")
    parser.add_argument("--line", type=int, default=8, help="steps timed one by one (a log interval)")
    parser.add_argument("--steady", type=int, default=16)
    parser.add_argument(
        "--profile", action="store_true", help="profile each shape's first and second steps (before the line)"
    )
    parser.add_argument(
        "--attention", choices=sorted(ATTENTION), default="default", help="the SDPA backends allowed"
    )
    args = parser.parse_args()
    with torch.nn.attention.sdpa_kernel(ATTENTION[args.attention]):
        run_shapes(args)


def run_shapes(args: argparse.Namespace) -> None:
    args.device, args.no_compile = DEVICE, True
    init_single_process_group(DEVICE)
    mbs_order = [int(m) for m in args.mbs.split(",")]
    model, optimizer, _ = engine_model(args.size, mbs_order[0], args)
    settings = {
        "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "default"),
        "module_loading": os.environ.get("CUDA_MODULE_LOADING", "default"),  # lazy unless EAGER
        "attention": args.attention,
    }
    for mbs in mbs_order:
        if mbs != model.strategy.mbs:
            model.rebatch(dataclasses.replace(model.strategy, mbs=mbs, gbs=mbs))
        print(json.dumps({**settings, **shape_rows(model, optimizer, mbs, args)}), flush=True)


if __name__ == "__main__":
    main()
