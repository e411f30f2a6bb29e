"""Where the time of ``bench/engine_vs_ref.py``'s reference step and of ours goes, on the device and on the
host; takes that script's flags plus one or more of these::

    PYTHONPATH=src:bench python bench/step_profiles.py --profile 125m:8 --host-phases 125m:8 --out prof/x.json

- ``profile``: torch.profiler tables of both steps (top kernels, top CPU ops) and the kernel time per step;
- ``host_phases``: host seconds per phase of each step (``perf_counter``, nothing synchronised between the
  phases) against the wall time per step: a step whose host sum equals its wall time is host-bound;
- ``host_profile``: a cProfile of our step (which Python calls the host time goes to).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from cona.engine.trainer import IntervalSums
from engine_vs_ref import (
    SIZES,
    RefGPT,
    build_parser,
    engine_model,
    engine_step,
    init_single_process_group,
    padded_vocab_size,
    parse_args,
    random_batch,
    reference_step,
    synchronize,
)


def profile(size: str, mbs: int, args: argparse.Namespace, out_dir: Path) -> None:
    """Top kernels and CPU ops of both steps, and how busy the GPU was (kernel time over wall time)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    steps = 5
    for name, build in (
        ("ref", partial(reference_step, size, mbs, args)),
        ("ours", partial(engine_step, size, mbs, args)),
    ):
        torch._dynamo.reset()
        step = build()
        for _ in range(args.warmup + 1):
            step()
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
            wall_ms = (time.perf_counter() - start) * 1e3 / steps
        averages = prof.key_averages()
        # Device-side events only (the table's "Self CUDA time total"); op rows repeat their kernels' time.
        kernel_ms = (
            sum(
                event.self_device_time_total
                for event in averages
                if event.device_type == DeviceType.CUDA and not getattr(event, "is_user_annotation", False)
            )
            / 1e3
            / steps
        )
        summary = (
            f"== {name} {size} mbs{mbs}: {wall_ms:.2f} ms/step wall (profiled), "
            f"{kernel_ms:.2f} ms/step of kernels"
        )
        print(summary, flush=True)
        text = "\n".join([
            summary, "-- by device time",
            averages.table(sort_by="self_device_time_total", row_limit=45, max_name_column_width=80),
            "-- by CPU time",
            averages.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=80),
        ])  # fmt: skip
        (out_dir / f"profile_{name}_{size}_mbs{mbs}.txt").write_text(text)
        del step
        torch.cuda.empty_cache()


def host_phases(size: str, mbs: int, args: argparse.Namespace) -> dict:
    """Host time per phase of each step (perf_counter, no synchronisation between phases) against the wall
    time per step: where the host's sum is the wall time, the step is host-bound, and that sum is what to
    cut."""
    steps = max(args.steps, 20)
    result = {}
    for name in ("ref", "ours"):
        torch._dynamo.reset()
        phases, step = _phase_step(name, size, mbs, args)
        for _ in range(args.warmup + 1):
            step()
        synchronize(args.device)
        for key in phases:
            phases[key] = 0.0
        start = time.perf_counter()
        for _ in range(steps):
            step()
        synchronize(args.device)
        wall_ms = (time.perf_counter() - start) * 1e3 / steps
        result[name] = {"wall_ms": round(wall_ms, 2)} | {
            key: round(value * 1e3 / steps, 3) for key, value in phases.items()
        }
        print(f"  host phases {name} {size} mbs{mbs}: {json.dumps(result[name])}", flush=True)
        del step
    return result


def host_profile(size: str, mbs: int, args: argparse.Namespace, out_dir: Path) -> None:
    """cProfile of our step on the host (GNS on every step): which Python calls the host time goes to."""
    import cProfile
    import io
    import pstats

    torch._dynamo.reset()
    _, step = _phase_step("ours", size, mbs, args)
    for _ in range(args.warmup + 1):
        step()
    synchronize(args.device)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(max(args.steps, 20)):
        step()
    synchronize(args.device)
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(35)
    stats.sort_stats("cumulative").print_stats(45)
    (out_dir / f"host_profile_{size}_mbs{mbs}.txt").write_text(text.getvalue())
    print(text.getvalue()[:6000], flush=True)


def _phase_step(name: str, size: str, mbs: int, args: argparse.Namespace) -> tuple[dict, Callable]:
    """A step like ``reference_step``/``engine_step`` (GNS on every step) that adds each phase's host
    seconds to the returned dict (ours: "train_step" includes "forward")."""
    phases: dict[str, float] = {}

    def timed(key: str, fn: Callable, *a, **kw):
        began = time.perf_counter()
        value = fn(*a, **kw)
        phases[key] = phases.get(key, 0.0) + time.perf_counter() - began
        return value

    if name == "ref":
        layers, h, heads = SIZES[size]
        model = RefGPT(layers, h, heads, vocab=padded_vocab_size(size), seq=args.seq).to(args.device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=args.device == "cuda")
        compiled = torch.compile(model) if not args.no_compile else model
        inputs, targets = random_batch(size, mbs, args.seq, args.device)

        def ref_step() -> None:
            with torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.device == "cuda"):
                loss = timed("forward", compiled, inputs, targets)
            timed("backward", loss.backward)
            timed("optimizer", opt.step)
            timed("zero_grad", opt.zero_grad, set_to_none=True)

        return phases, ref_step
    model, optimizer, config = engine_model(size, mbs, args)
    forward = model._forward_loss
    model._forward_loss = lambda *a: timed("forward", forward, *a)
    batch = [random_batch(size, mbs, args.seq, args.device)]
    interval = IntervalSums()

    def our_step() -> None:
        began = time.perf_counter()
        out = model.train_step_pending(batch, measure_gns=True)
        phases["train_step"] = phases.get("train_step", 0.0) + time.perf_counter() - began
        norm = timed("clip", model.clip_grad_norm_pending, config.training.optimizer.clip_grad)
        stepped = timed("optimizer", model.optimizer_step_pending, optimizer)
        timed("zero_grad", optimizer.zero_grad, set_to_none=True)
        timed("interval_sums", interval.add, out, norm, stepped)

    return phases, our_step


def main() -> None:
    parser = build_parser(__doc__.splitlines()[0])
    parser.add_argument("--profile", default=None, metavar="SIZE:MBS", help="torch.profiler tables")
    parser.add_argument("--host-profile", default=None, metavar="SIZE:MBS", help="cProfile of our step")
    parser.add_argument(
        "--host-phases",
        default=None,
        metavar="SIZE:MBS",
        help="host time per phase of each step (ref and ours) against the wall time per step",
    )
    args = parse_args(parser)
    torch.backends.cuda.matmul.allow_tf32 = True  # as the reference does
    init_single_process_group(args.device)
    out_dir = args.out.parent if args.out else Path(".")
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.host_phases:
        size, mbs = args.host_phases.split(":")
        phases = host_phases(size, int(mbs), args)
        (out_dir / "host_phases.json").write_text(json.dumps(phases, indent=1) + "\n")
    if args.host_profile:
        size, mbs = args.host_profile.split(":")
        host_profile(size, int(mbs), args, out_dir)
    if args.profile:
        size, mbs = args.profile.split(":")
        profile(size, int(mbs), args, out_dir)


if __name__ == "__main__":
    main()
