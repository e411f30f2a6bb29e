"""Where CONA's eager step spends host time that the plain-PyTorch reference does not (issue 16: below gbs 32
an eager GPT-125M step on one GPU is host-bound, so every host op is step time).

One process times both steps eager at one micro-batch size (``bench/engine_vs_ref.py``'s reference and
our whole step: forward and backward, clipping, the optimizer, no gradient-noise measurement), then prints
per step: the CPU ops and the kernels of each (torch.profiler), the ops ours runs more of (by their extra
self time) and the kernels it launches more of (by count), and a cProfile of each step's Python calls.
Run on the device from the repository root::

    PYTHONPATH=src python3 bench/host_ops_vs_ref.py --size 125m --mbs 8

``--device cpu --size tiny`` is a smoke run (on a CPU the foreach ops run one tensor at a time, so its op
counts are not a GPU's).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from collections.abc import Callable

import torch
from torch.autograd import DeviceType

from engine_vs_ref import engine_model, init_single_process_group, random_batch, reference_step, synchronize

PROFILED_STEPS = 5
ROWS = 30


def whole_step(args: argparse.Namespace) -> Callable[[], None]:
    model, optimizer, config = engine_model(args.size, args.mbs, args)
    batch = random_batch(args.size, args.mbs, args.seq, args.device)

    def step() -> None:
        model.train_step_pending([batch], measure_gns=False)
        model.clip_grad_norm_pending(config.training.clip_grad)
        model.optimizer_step_pending(optimizer)
        optimizer.zero_grad(set_to_none=True)

    return step


def step_ms(step: Callable[[], object], args: argparse.Namespace) -> float:
    for _ in range(args.warmup):
        step()
    synchronize(args.device)
    began = time.perf_counter()
    for _ in range(args.steps):
        step()
    synchronize(args.device)
    return (time.perf_counter() - began) / args.steps * 1e3


def op_table(step: Callable[[], object], device: str) -> tuple[dict, dict]:
    """Per step: {CPU op: (calls, self ms)} and {kernel: (launches, ms)}."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profile:
        for _ in range(PROFILED_STEPS):
            step()
        synchronize(device)
    cpu, kernels = {}, {}
    for event in profile.key_averages():
        if event.device_type == DeviceType.CPU:
            cpu[event.key] = (event.count / PROFILED_STEPS, event.self_cpu_time_total / PROFILED_STEPS / 1e3)
        elif event.device_type == DeviceType.CUDA:
            kernels[event.key] = (
                event.count / PROFILED_STEPS,
                event.self_device_time_total / PROFILED_STEPS / 1e3,
            )
    return cpu, kernels


def print_extra(title: str, ours: dict, ref: dict, by: int) -> None:
    """Rows sorted by how much more of column ``by`` (0: count, 1: ms) ours has."""
    print(f"{title}: ours count, ms | ref count, ms")
    keys = sorted(set(ours) | set(ref), key=lambda k: -(ours.get(k, (0, 0))[by] - ref.get(k, (0, 0))[by]))
    for key in keys[:ROWS]:
        (n_ours, ms_ours), (n_ref, ms_ref) = ours.get(key, (0, 0)), ref.get(key, (0, 0))
        print(f"{n_ours:6.0f} {ms_ours:6.2f} | {n_ref:6.0f} {ms_ref:6.2f}  {key[:90]}")


def python_profile(step: Callable[[], object], args: argparse.Namespace) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.steps):
        step()
    synchronize(args.device)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(ROWS)
    return text.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="125m")
    parser.add_argument("--mbs", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    args.no_compile = True
    init_single_process_group(args.device)
    steps = {"ours": whole_step(args), "ref": reference_step(args.size, args.mbs, args)}
    for _ in range(2):  # twice: the host's speed drifts between rounds
        print(
            " ".join(f"{name} {step_ms(step, args):.2f} ms/step" for name, step in steps.items()), flush=True
        )
    (cpu_ours, k_ours), (cpu_ref, k_ref) = (op_table(steps[name], args.device) for name in ("ours", "ref"))
    for name, cpu, kernels in (("ours", cpu_ours, k_ours), ("ref", cpu_ref, k_ref)):
        ops, self_ms = sum(n for n, _ in cpu.values()), sum(ms for _, ms in cpu.values())
        launched = sum(n for n, _ in kernels.values())
        print(f"{name}: {ops:.0f} CPU ops ({self_ms:.2f} ms self), {launched:.0f} kernels")
    print_extra("CPU ops, by extra self ms", cpu_ours, cpu_ref, by=1)
    if args.device == "cuda":
        print_extra("kernels, by extra launches", k_ours, k_ref, by=0)
    for name, step in steps.items():
        print(f"=== cProfile {name}, {args.steps} steps\n{python_profile(step, args)}", flush=True)


if __name__ == "__main__":
    main()
