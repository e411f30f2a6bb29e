"""First call on a machine with several GPUs: are its collectives and CONA's layouts sound (in under two
minutes)?

1. **all-reduce**: ``--gpus`` processes (NCCL on GPUs, gloo on a CPU) all-reduce a known tensor; the sum
   must be exact, and its bus bandwidth is printed (``2 (n - 1) / n`` x bytes / seconds, as nccl-tests).
2. **noise**: one device trains the GPT twice, at mbs M and at mbs 2M (the same function, summed in another
   order): the largest relative difference of their per-iteration losses is this machine's rounding noise
   for the dtype. The bound of the checks below is ``NOISE_MULTIPLE`` times it, at least the dtype's floor
   (:data:`REL_FLOOR`).
3. **parity**: the same iterations under dp2, tp2 and pp2 (two devices) against one device: every
   iteration's loss within the bound.
4. **layout-only chain**: dp2 -> tp2 -> pp2 at the same gbs and mbs (``cona train --chain``, each switch
   through a checkpoint), against the dp2 run of as many iterations: every loss within the bound.

The data are documents of a few short token patterns repeated (the loss falls from ln(vocab) within the
first iterations, so a wrong gradient shows), written to a temporary folder: nothing is downloaded and no
corpus is needed. The training runs share the ``--gpus`` devices, as many at a time as fit (all at once on
eight), so the whole check takes about as long as two runs; on a CPU they run one after another. One line
per check (``ok`` or ``FAIL`` with the numbers); exit status 1 when any failed::

    PYTHONPATH=src python3 bench/multi_gpu_check.py --gpus 8 --out $OUT/check.json  # GPUs, bf16
    PYTHONPATH=src .venv/bin/python bench/multi_gpu_check.py --device cpu           # 2 CPU processes, fp32
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

PROJECT_ROOT = Path(__file__).resolve().parents[1]
VOCAB = 50257
SIZES = {"tiny": (4, 64, 4, 128), "125m": (12, 768, 12, 512)}
"""(layers, hidden, heads, seq) of ``--size``."""
REL_FLOOR = {"fp32": 1e-4, "bf16": 2.0**-8}
"""The least relative loss difference the checks allow: fp32 sums in another order differ by ~1e-7 over a
few Adam steps, 1e-4 leaves room for other kernels; bf16's unit roundoff is 2^-8."""
NOISE_MULTIPLE = 4.0
"""The bound over the measured noise: a layout sums in other orders than the two one-device runs do (tp's
partial sums, pp's micro-batch order), so its difference may exceed theirs by a small factor, not by more."""
LAYOUTS = {"dp2": (2, 1, 1), "tp2": (1, 2, 1), "pp2": (1, 1, 2)}
RUN_TIMEOUT_S = 300
"""A run that has not ended by then is killed (its check fails)."""
ALL_REDUCE_MB = {"cuda": 256, "cpu": 4}
"""Message size of the timed all-reduce, in MiB."""


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.all_reduce_worker:
        return all_reduce_worker(args.device)
    root = Path(tempfile.mkdtemp(prefix="cona-gpu-check-", dir=args.workdir)).resolve()
    started = time.time()
    results = {"all-reduce": check_all_reduce(args)} if "all-reduce" in args.checks else {}
    if set(args.checks) - {"all-reduce"}:
        results.update(check_training(args, root))
    failed = [name for name, result in results.items() if not result["ok"]]
    print(f"multi_gpu_check: {len(results) - len(failed)}/{len(results)} ok in {time.time() - started:.0f} s")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"settings": vars(args), "checks": results}, indent=1) + "\n")
    return 1 if failed else 0


CHECKS = ("all-reduce", "noise", "dp2", "tp2", "pp2", "chain")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--gpus", type=int, default=2, help="processes of the all-reduce (the layouts use 2)")
    parser.add_argument("--size", choices=tuple(SIZES), default=None, help="GPT (default: 125m, CPU tiny)")
    parser.add_argument("--iters", type=int, default=6, help="iterations of each run (the chain: 3 stages)")
    parser.add_argument("--gbs", type=int, default=8)
    parser.add_argument("--mbs", type=int, default=2)
    parser.add_argument("--checks", default=",".join(CHECKS), help=f"comma list of {', '.join(CHECKS)}")
    parser.add_argument("--workdir", default=None, help="parent of the temporary folder")
    parser.add_argument("--out", default=None, help="also write the results as JSON")
    parser.add_argument("--all-reduce-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.checks = [c.strip() for c in args.checks.split(",") if c.strip()]
    unknown = sorted(set(args.checks) - set(CHECKS))
    if unknown:
        parser.error(f"--checks: unknown {', '.join(unknown)} (choose from {', '.join(CHECKS)})")
    args.size = args.size or ("125m" if args.device == "cuda" else "tiny")
    if args.iters < 3 or args.iters % 3:
        parser.error(f"--iters {args.iters}: give a multiple of 3 (the chain trains a third in each layout)")
    if args.gbs % (2 * args.mbs * 2):
        parser.error(f"--gbs {args.gbs}: must be a multiple of 4 x --mbs (dp2 at mbs and 2 mbs)")
    return args


# ------------------------------------------------------------------------------------------- all-reduce


def check_all_reduce(args: argparse.Namespace) -> dict[str, Any]:
    """The all-reduce worker on ``--gpus`` processes under torchrun; its rank 0's result line."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.gpus),
               "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), __file__,
               "--all-reduce-worker", "--device", args.device]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": _python_path()}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    line = next((x for x in done.stdout.splitlines() if x.startswith("ALLREDUCE ")), None)
    if done.returncode != 0 or line is None:
        result = {"ok": False, "error": (done.stdout + done.stderr)[-2000:]}
        print(f"all-reduce: FAIL (exit {done.returncode})\n{result['error']}", flush=True)
        return result
    result = json.loads(line.removeprefix("ALLREDUCE "))
    print(
        f"all-reduce: {'ok' if result['ok'] else 'FAIL'}: {args.gpus} x {result['backend']}, sum "
        f"{'exact' if result['ok'] else 'WRONG'}, {result['mib']} MiB in {result['ms']:.2f} ms, "
        f"bus {result['bus_gb_s']:.1f} GB/s",
        flush=True,
    )
    return result


def all_reduce_worker(device: str) -> int:
    """One rank: all-reduce ``rank + 1`` everywhere (the sum is ``n (n + 1) / 2`` exactly), then time it."""
    import torch
    import torch.distributed as dist

    backend = "nccl" if device == "cuda" else "gloo"
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend)
    mib = ALL_REDUCE_MB[device]
    tensor = torch.full((mib * 2**20 // 4,), float(rank + 1), device=device)
    dist.all_reduce(tensor)
    ok = bool((tensor == world * (world + 1) / 2).all().item())
    times = []
    for _ in range(5):
        _synchronize(device)
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(tensor)
        _synchronize(device)
        times.append(time.perf_counter() - start)
    seconds = float(np.median(times))
    if rank == 0:
        bus = 2 * (world - 1) / world * mib * 2**20 / seconds / 1e9
        result = {"ok": ok, "backend": backend, "mib": mib, "ms": seconds * 1e3, "bus_gb_s": bus}
        print("ALLREDUCE " + json.dumps(result), flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


def _synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


# --------------------------------------------------------------------------------------------- training


@dataclass(frozen=True)
class Run:
    """One ``cona train`` of the checks: a layout (None: the layout-only chain) at an mbs."""

    name: str
    layout: tuple[int, int, int] | None
    mbs: int

    @property
    def devices(self) -> int:
        return 2 if self.layout is None else math.prod(self.layout)


def check_training(args: argparse.Namespace, root: Path) -> dict[str, dict[str, Any]]:
    """The noise, parity and chain checks that ``args.checks`` names, on one data set and config."""
    config = write_setup(args, root)
    dtype = "bf16" if args.device == "cuda" else "fp32"
    wanted = [Run("one", (1, 1, 1), args.mbs)]
    if "noise" in args.checks:
        wanted.append(Run("one-mbs2x", (1, 1, 1), 2 * args.mbs))
    wanted += [Run(name, layout, args.mbs) for name, layout in LAYOUTS.items()
               if name in args.checks or (name == "dp2" and "chain" in args.checks)]  # fmt: skip
    if "chain" in args.checks:
        wanted.append(Run("chain", None, args.mbs))
    runs = train_all(config, root, wanted, args)
    results: dict[str, dict[str, Any]] = {}
    floor = REL_FLOOR[dtype]
    if "noise" in args.checks:
        noise = worst_difference(runs["one"], runs["one-mbs2x"])
        floor = max(floor, NOISE_MULTIPLE * noise)
        results["noise"] = report("noise", ok=noise <= REL_FLOOR[dtype], worst=noise, bound=REL_FLOOR[dtype])
    for name in LAYOUTS:
        if name in args.checks:
            worst = worst_difference(runs["one"], runs[name])
            results[name] = report(name, ok=worst <= floor, worst=worst, bound=floor)
    if "chain" in args.checks:
        worst = worst_difference(runs["dp2"], runs["chain"])
        stages = {r["stage"] for r in runs["chain"]}
        results["chain"] = report("chain", ok=worst <= floor and len(stages) == 3, worst=worst, bound=floor)
    return results


def train_all(config: Path, root: Path, wanted: list[Run], args: argparse.Namespace) -> dict[str, list]:
    """Every run's metrics records. On GPUs the runs share the ``--gpus`` devices, as many at a time as
    fit (each sees its own through ``CUDA_VISIBLE_DEVICES``); on a CPU they run one after another. A run
    that needs more devices than there are is not started (its records are empty: its check fails)."""
    slots = args.gpus if args.device == "cuda" else 0
    free, running, records = list(range(slots)), [], {}
    for run in wanted:
        if slots and run.devices > slots:
            print(f"  {run.name}: needs {run.devices} devices, --gpus is {slots}: not run", flush=True)
            records[run.name] = []
            continue
        while running and (not slots or len(free) < run.devices):
            free += finish(*running.pop(0), root, records)
        devices = [free.pop(0) for _ in range(run.devices)] if slots else []
        running.append((run, devices, start(config, root, run, args, devices), time.time()))
    while running:
        free += finish(*running.pop(0), root, records)
    return records


def start(config: Path, root: Path, run: Run, args: argparse.Namespace, devices: list[int]) -> Any:
    """``cona train`` of one run in the background, its output to ``<root>/<name>.log``."""
    command = [sys.executable, "-m", "cona", "train", "--config", str(config),
               "--workdir", str(root / run.name), "--run-name", run.name, "--quiet"]  # fmt: skip
    if run.layout is None:
        chain = root / "chain.json"
        chain.write_text(json.dumps(layout_chain(args)))
        command += ["--chain", str(chain), "--gpus", "2"]
    else:
        dp, tp, pp = run.layout
        command += ["--dp", str(dp), "--tp", str(tp), "--pp", str(pp), "--gbs", str(args.gbs),
                    "--mbs", str(run.mbs), "--iters", str(args.iters)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": _python_path()}
    if devices:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devices))
    with open(root / f"{run.name}.log", "w") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)


def finish(
    run: Run, devices: list[int], process: Any, started: float, root: Path, records: dict
) -> list[int]:
    """Wait for one run, keep its records, print its line (its log's tail where it failed); its devices."""
    try:
        code = process.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        code = process.wait()
    metrics = root / "logs" / run.name / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.is_file() else []
    records[run.name] = [r for r in map(json.loads, lines) if "loss" in r]
    print(f"  {run.name}: exit {code}, {len(records[run.name])} iterations in {time.time() - started:.1f} s")
    if code != 0:
        print((root / f"{run.name}.log").read_text()[-2000:], flush=True)
    return devices


def report(name: str, *, ok: bool, worst: float, bound: float) -> dict[str, Any]:
    what = "one device at mbs and 2 mbs" if name == "noise" else f"{name} against its reference"
    print(
        f"{name}: {'ok' if ok else 'FAIL'}: {what}: largest relative loss difference {worst:.2e} "
        f"(bound {bound:.2e})",
        flush=True,
    )
    return {"ok": ok, "worst_rel_diff": worst, "bound": bound}


def worst_difference(reference: list[dict[str, Any]], other: list[dict[str, Any]]) -> float:
    """The largest relative difference of two runs' losses at the same iterations (inf where the runs did
    not log the same iterations: a run that stopped early fails)."""
    ours = {r["iteration"]: r["loss"] for r in reference}
    theirs = {r["iteration"]: r["loss"] for r in other}
    if not ours or set(ours) != set(theirs):
        return float("inf")
    return max(abs(theirs[i] - ours[i]) / abs(ours[i]) for i in ours)


def write_setup(args: argparse.Namespace, root: Path) -> Path:
    """The pattern data set and the .conaconfig of every run."""
    from cona.data.indexed import IndexedDatasetWriter

    rng = np.random.default_rng(0)
    patterns = [rng.integers(0, VOCAB, size=int(rng.integers(5, 17))) for _ in range(8)]
    layers, hidden, heads, seq = SIZES[args.size]
    documents = max(200, 4 * args.iters * args.gbs)  # the 2% validation split must not be empty
    (root / "data").mkdir(parents=True, exist_ok=True)
    with IndexedDatasetWriter(root / "data" / "patterns", np.uint16) as writer:
        for _ in range(documents):
            pattern = patterns[int(rng.integers(len(patterns)))]
            writer.add_document(np.tile(pattern, seq // len(pattern) + 2)[: seq + 1])
    config = {
        "model": {"name": f"gpt-{args.size}", "layers": layers, "hidden": hidden, "heads": heads, "seq": seq,
                  "vocab_size": VOCAB, "attention_dropout": 0.0, "hidden_dropout": 0.0},
        "training": {"device": args.device, "dtype": "bf16" if args.device == "cuda" else "fp32",
                     "base_gbs": args.gbs, "base_lr": 1e-3, "base_min_lr": 1e-4, "lr_warmup_frac": 0.0,
                     "split": "98,2,0", "data_prefix": str(root / "data" / "patterns"), "log_interval": 1,
                     "eval_interval": 1_000_000, "eval_iters": 1, "log_root": str(root / "logs"),
                     "compile": False, "wandb_mode": "disabled"},
    }  # fmt: skip
    path = root / ".conaconfig"
    path.write_text(json.dumps(config, indent=1))
    return path


def layout_chain(args: argparse.Namespace) -> dict[str, Any]:
    """dp2 -> tp2 -> pp2 at one gbs and mbs, a third of ``--iters`` in each, every switch checkpointed."""
    steps, previous = [], None
    for index, (dp, tp, pp) in enumerate(LAYOUTS.values()):
        step = {"step_num": index + 1, "dp": dp, "tp": tp, "pp": pp, "gbs": args.gbs, "mbs": args.mbs,
                "train_iters": (index + 1) * args.iters // 3,
                "convert": index < len(LAYOUTS) - 1}  # fmt: skip
        if previous is None:
            step["is_initial"] = True
        else:
            step |= {"load_dp": previous[0], "load_tp": previous[1], "load_pp": previous[2]}
        steps.append(step)
        previous = (dp, tp, pp)
    return {"steps": steps}


def _python_path() -> str:
    """The workers import this checkout's cona, whatever the caller's cwd."""
    return os.pathsep.join(filter(None, [str(PROJECT_ROOT / "src"), os.environ.get("PYTHONPATH")]))


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


if __name__ == "__main__":
    raise SystemExit(main())
