"""How an eager step's time grows with the micro-batch on one GPU, and what a noise-measured step costs
(issue 16: the first trial's prediction, made before any rate of the run is measured).

One process builds CONA's training model eager (no compile) and, at each mbs (gbs = mbs, one micro-batch,
dp = 1), times the trainer's step (forward and backward, clipping, the optimizer, zeroing) three ways:

- ``whole_ms``: steady steps, nothing synchronised between them (as a run's metrics interval);
- ``pieces_ms``: the same with the gradient-noise inputs measured on every step, which cuts the single
  micro-batch into pieces (as the steps before a run's first metrics line);
- ``kernel_ms``: the device's kernel time of a whole step (torch.profiler, summed over kernels), so that
  ``whole_ms - kernel_ms`` is the time the device waited for the host;
- ``first_step_ms``: the fresh model's first step at that mbs (allocation, library heuristics);
- ``in_place_to_next``: the warmed model's first and second step at the next mbs (an in-place switch);
- ``phases``: per phase (forward and backward, clipping, the optimizer and zeroing), the host's time
  dispatching it and its span on the device's timeline between CUDA events: where the device waits.

Each time is the median of ``--repeats`` rounds of ``--steps`` steps after ``--warmup`` steps. Run on the
device from the repository root::

    PYTHONPATH=src python3 bench/eager_step_shape.py --mbs 8,16,32,64

``--compiled`` times the same step compiled without CUDA graphs, the mode the host prior of the performance
model was measured in (:data:`cona.planner.profiles.NATIVE_HOST`), for the eager host's ratio to it on one
host: only ``first_step_ms`` (the compile), ``whole_ms``, ``kernel_ms`` and the phases (pieces and a new
shape would compile again).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from engine_vs_ref import engine_model, init_single_process_group, random_batch, synchronize

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke run of the script
PROFILED_STEPS = 5
HOST_TOP = 8


def phases(model, optimizer, batch, *, measure: bool) -> dict[str, Callable[[], object]]:
    """The trainer's step in the phases the host dispatches one after the other."""

    def update() -> None:
        model.optimizer_step_pending(optimizer)
        optimizer.zero_grad(set_to_none=True)

    return {
        "forward_backward": lambda: model.train_step_pending([batch], measure_gns=measure),
        "clip": lambda: model.clip_grad_norm_pending(1.0),
        "optimizer": update,
    }


def step(model, optimizer, batch, *, measure: bool) -> None:
    for run in phases(model, optimizer, batch, measure=measure).values():
        run()


def phase_ms(model, optimizer, batch, args: argparse.Namespace) -> dict[str, dict[str, float]] | None:
    """Per phase of a whole step: the host's seconds dispatching it (nothing synchronised) and the span
    between CUDA events recorded around it on the device's timeline (its kernels and the device's waits
    for the host inside it), means over ``--steps`` steady steps (None on a CPU)."""
    if DEVICE != "cuda":
        return None
    named = phases(model, optimizer, batch, measure=False)
    host = dict.fromkeys(named, 0.0)
    spans = []
    for _ in range(args.steps):
        events = [torch.cuda.Event(enable_timing=True) for _ in range(len(named) + 1)]
        events[0].record()
        for index, (name, run) in enumerate(named.items()):
            began = time.perf_counter()
            run()
            host[name] += time.perf_counter() - began
            events[index + 1].record()
        spans.append(events)
    synchronize(DEVICE)
    device = {name: sum(e[i].elapsed_time(e[i + 1]) for e in spans) for i, name in enumerate(named)}
    return {
        name: {
            "host_ms": round(host[name] / args.steps * 1e3, 2),
            "device_span_ms": round(device[name] / args.steps, 2),
        }
        for name in named
    }


def first_step_ms(model, optimizer, batch) -> float:
    """The first step of a fresh model at this shape (what a run or an in-place switch to a new mbs pays
    once: allocations, library heuristics), synchronised."""
    synchronize(DEVICE)
    began = time.perf_counter()
    step(model, optimizer, batch, measure=False)
    synchronize(DEVICE)
    return (time.perf_counter() - began) * 1e3


def in_place_step_ms(model, optimizer, args: argparse.Namespace, mbs: int | None) -> dict | None:
    """The first two steps of the warmed model at the next mbs: what an in-place switch to a shape the run
    has not run yet pays once (``first_ms`` against ``second_ms``)."""
    if mbs is None:
        return None
    batch = random_batch(args.size, mbs, args.seq, DEVICE)
    first = first_step_ms(model, optimizer, batch)
    return {
        "mbs": mbs,
        "first_ms": round(first, 2),
        "second_ms": round(first_step_ms(model, optimizer, batch), 2),
    }


def steady_ms(model, optimizer, batch, args: argparse.Namespace, *, measure: bool) -> float:
    for _ in range(args.warmup):
        step(model, optimizer, batch, measure=measure)
    synchronize(DEVICE)
    rounds = []
    for _ in range(args.repeats):
        began = time.perf_counter()
        for _ in range(args.steps):
            step(model, optimizer, batch, measure=measure)
        synchronize(DEVICE)
        rounds.append((time.perf_counter() - began) / args.steps * 1e3)
    return statistics.median(rounds)


def kernel_ms(model, optimizer, batch) -> tuple[float | None, list[dict]]:
    """The device's kernel time per whole step (None on a CPU), and the host calls that wait for the device
    (synchronisations, device-to-host copies) or cost the most host time of their own, per step."""
    if DEVICE != "cuda":
        return None, []
    from torch.autograd import DeviceType

    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        for _ in range(PROFILED_STEPS):
            step(model, optimizer, batch, measure=False)
        synchronize(DEVICE)
    events = profile.key_averages()
    kernel_us = sum(event.self_device_time_total for event in events if event.device_type == DeviceType.CUDA)
    host = [event for event in events if event.device_type == DeviceType.CPU]
    waits = [
        e for e in host if any(word in e.key for word in ("Synchronize", "Memcpy", "item", "_local_scalar"))
    ]
    top = sorted(host, key=lambda e: -e.self_cpu_time_total)[:HOST_TOP]
    calls = [
        {
            "op": e.key,
            "calls_per_step": e.count / PROFILED_STEPS,
            "self_ms": e.self_cpu_time_total / PROFILED_STEPS / 1e3,
        }
        for e in dict.fromkeys([*waits, *top])
    ]
    return kernel_us / PROFILED_STEPS / 1e3, [
        {k: round(v, 3) if isinstance(v, float) else v for k, v in c.items()} for c in calls
    ]


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="125m")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--mbs", default="8,16,32,64")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compiled", action="store_true", help="compiled, CUDA graphs off (see above)")
    args = parser.parse_args()
    args.device, args.no_compile, args.cuda_graphs = DEVICE, not args.compiled, False
    init_single_process_group(DEVICE)
    sizes = [int(m) for m in args.mbs.split(",")]
    for mbs, next_mbs in zip(sizes, [*sizes[1:], None], strict=True):
        model, optimizer, _ = engine_model(args.size, mbs, args)
        batch = random_batch(args.size, mbs, args.seq, DEVICE)
        first = first_step_ms(model, optimizer, batch)
        whole = steady_ms(model, optimizer, batch, args, measure=False)
        pieces = None if args.compiled else steady_ms(model, optimizer, batch, args, measure=True)
        kernels, host_calls = kernel_ms(model, optimizer, batch)
        by_phase = phase_ms(model, optimizer, batch, args)
        row = {
            "size": args.size,
            "mode": "compiled, no CUDA graphs" if args.compiled else "eager",
            "mbs": mbs,
            "first_step_ms": round(first, 2),
            "whole_ms": round(whole, 2),
            "pieces_ms": None if pieces is None else round(pieces, 2),
            "pieces_over_whole": None if pieces is None else round(pieces / whole, 3),
            "kernel_ms": None if kernels is None else round(kernels, 2),
            "device_idle_ms": None if kernels is None else round(whole - kernels, 2),
            "phases": by_phase,
            "host_calls": host_calls,
            "in_place_to_next": None if args.compiled else in_place_step_ms(model, optimizer, args, next_mbs),
        }
        print(json.dumps(row), flush=True)
        del model, optimizer
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
