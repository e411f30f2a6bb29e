"""Engine throughput against a plain-PyTorch reference, on one GPU, measured in the same process.

For each GPT size and micro-batch size this times (1) THE REFERENCE: a single-file GPT training step
(bf16 autocast, SDPA flash attention, torch.compile of the whole model, fused AdamW), adapted from the
project's reference benchmark ``gpt_ref.py``, and (2) CONA'S ENGINE: the step path of the trainer,
``train_step_pending`` (gradient-noise inputs measured on the last steps before each metrics line, as the
trainer does) + ``clip_grad_norm_pending`` + ``optimizer_step_pending``, with the interval sums kept on the
device and read once per log interval, under a 1-process NCCL group, dp = tp = pp = 1, bf16, dropout 0,
compile on. Random tokens; throughput does not depend on the data. Each row (tokens/s of both and the ratio
ours/ref) is printed as soon as it is measured, so a run cut short by a time limit still reports rows.

    PYTHONPATH=src python bench/engine_vs_ref.py --sizes 125m,350m,1.3b --mbs 8,16 --out results.json

``--gns-overhead`` times our step with the gradient-noise inputs measured on every step, on the trainer's
steps and switched off (``TrainingModel.disable_gns``) instead of the reference. ``--compile-scope`` sets
``training.compile_scope`` (``auto``, ``model`` or ``blocks``). ``bench/step_profiles.py`` takes the same
flags and writes profiles of both steps. ``--device cpu --sizes tiny --no-compile`` is a smoke run
(1-process gloo group, fp32) for tests.

Every graph has static shapes, so a measured step's pieces compile a second graph: ``--warmup`` must cover the
first measured step (the trainer's rule measures the last step before each metrics line, every 10th).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cona.config import ModelConfig, TrainingConfig, parse_config
from cona.engine.optim import build_optimizer
from cona.engine.parallel_dims import build_mesh
from cona.engine.train_model import TrainingModel, build_training_model
from cona.engine.trainer import IntervalSums, gns_steps_per_line
from cona.planner.flops import training_flops_per_token
from cona.strategy import Strategy

SIZES = {
    "tiny": (2, 64, 4),
    "45m": (6, 512, 8),
    "125m": (12, 768, 12),
    "350m": (24, 1024, 16),
    "760m": (24, 1536, 16),
    "1.3b": (24, 2048, 16),
}
GPT2_VOCAB = 50257  # padded to 50304 by make_vocab_size_divisible_by=128, the reference's vocabulary
TINY_VOCAB = 256  # the CPU smoke size: a GPT-2 vocabulary would dominate its step time


def vocab_size(size: str) -> int:
    return TINY_VOCAB if size == "tiny" else GPT2_VOCAB


def padded_vocab_size(size: str) -> int:
    return TINY_VOCAB if size == "tiny" else 50304


PEAK_BF16_TFLOPS = 989.0  # H100/H200 dense bf16 datasheet rate (cona.engine.metrics.PEAK_TFLOPS)


# ----------------------------------------------------------------------------------------------------
# THE REFERENCE (adapted from the project's gpt_ref.py; not CONA code): fused qkv, whole-model compile.
# ----------------------------------------------------------------------------------------------------
class RefBlock(nn.Module):
    def __init__(self, h: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.ln2 = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, 4 * h)
        self.fc2 = nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=2)
        q, k, v = (z.view(b, t, self.heads, h // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class RefGPT(nn.Module):
    def __init__(self, layers: int, h: int, heads: int, vocab: int = 50304, seq: int = 1024) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, h)
        self.wpe = nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(RefBlock(h, heads) for _ in range(layers))
        self.lnf = nn.LayerNorm(h)
        self.head = nn.Linear(h, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.lnf(x))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def reference_step(size: str, mbs: int, args: argparse.Namespace) -> Callable[[], object]:
    layers, h, heads = SIZES[size]
    torch.manual_seed(0)
    model = RefGPT(layers, h, heads, vocab=padded_vocab_size(size), seq=args.seq).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=args.device == "cuda")
    step_fn = torch.compile(model) if not args.no_compile else model
    inputs, targets = random_batch(size, mbs, args.seq, args.device)
    # bf16 autocast on the GPU; fp32 on the CPU, as the engine trains there.
    autocast_dtype = torch.bfloat16 if args.device == "cuda" else torch.float32

    def step() -> torch.Tensor:
        with torch.autocast(args.device, dtype=autocast_dtype, enabled=args.device == "cuda"):
            loss = step_fn(inputs, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


# ----------------------------------------------------------------------------------------------------
# CONA's engine: the worker's step path.
# ----------------------------------------------------------------------------------------------------
def engine_config(
    size: str, seq: int, compile_: bool, device: str, *, cuda_graphs: bool = True, compile_scope: str = "auto"
) -> tuple[ModelConfig, object]:
    layers, hidden, heads = SIZES[size]
    raw = {
        "model": {
            "name": f"gpt-{size}",
            "layers": layers,
            "hidden": hidden,
            "heads": heads,
            "seq": seq,
            "vocab_size": vocab_size(size),
            "attention_dropout": 0.0,
            "hidden_dropout": 0.0,
        },
        "training": {
            "device": device,
            "dtype": "bf16",  # fp32 on the CPU (resolved_dtype)
            "zero_stage": 0,
            "compile": compile_,
            "cuda_graphs": cuda_graphs,
            "compile_scope": compile_scope,
            "clip_grad": 1.0,
        },
    }
    config = parse_config(raw)
    return config.model, config


def engine_model(size: str, mbs: int, args: argparse.Namespace) -> tuple[TrainingModel, object, object]:
    cuda_graphs = getattr(args, "cuda_graphs", True)
    _, config = engine_config(
        size,
        args.seq,
        not args.no_compile,
        args.device,
        cuda_graphs=cuda_graphs,
        compile_scope=getattr(args, "compile_scope", "auto"),
    )
    training: TrainingConfig = config.training
    strategy = Strategy(
        dp=1,
        tp=1,
        pp=1,
        mbs=mbs,
        gbs=mbs,
        zero_stage=training.runtime.zero_stage,
        recompute=training.runtime.recompute,
    )
    mesh = build_mesh(strategy, args.device)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    model = build_training_model(config, strategy, mesh, device)
    optimizer = build_optimizer(model.model_parts, training)
    for group in optimizer.param_groups:
        group["lr"] = 1e-4
    return model, optimizer, config


def engine_step(size: str, mbs: int, args: argparse.Namespace, gns: str = "trainer") -> Callable[[], object]:
    """Our step as the trainer runs it. ``gns``: "trainer" measures the gradient-noise inputs on the last
    steps before each metrics line (the trainer's rule), "every" on every step, "off" never."""
    model, optimizer, config = engine_model(size, mbs, args)
    if gns == "off":
        model.disable_gns()
    log_interval = config.training.logging.log_interval
    measured_steps = gns_steps_per_line(log_interval, single_step=model.measures_noise_in_one_step)
    batch = [random_batch(size, mbs, args.seq, args.device)]
    state = {"iteration": 0, "interval": IntervalSums()}

    def step() -> object:
        upcoming = state["iteration"] + 1
        measure = gns == "every" or (gns == "trainer" and (-upcoming) % log_interval < measured_steps)
        out = model.train_step_pending(batch, measure_gns=measure)
        grad_norm = model.clip_grad_norm_pending(config.training.optimizer.clip_grad)
        stepped = model.optimizer_step_pending(optimizer)
        optimizer.zero_grad(set_to_none=True)
        state["interval"].add(out, grad_norm, stepped)
        state["iteration"] = upcoming
        if upcoming % log_interval == 0:  # the trainer's metrics line: the one host read of the interval
            state["interval"].means()
            state["interval"] = IntervalSums()
        return out

    return step


# ----------------------------------------------------------------------------------------------------
def random_batch(size: str, mbs: int, seq: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, vocab_size(size), (mbs, seq + 1), device=device)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def seconds_per_step(step: Callable[[], object], args: argparse.Namespace) -> float:
    """Median over ``repeats`` rounds of the mean wall time of ``steps`` steps, after ``warmup`` steps."""
    for _ in range(args.warmup):
        step()
    synchronize(args.device)
    rounds = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        synchronize(args.device)
        rounds.append((time.perf_counter() - start) / args.steps)
    return statistics.median(rounds)


def measure(name: str, build: Callable[[], Callable[[], object]], args: argparse.Namespace) -> dict:
    torch._dynamo.reset()  # each configuration compiles for its own static shapes, as a worker would
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    compile_start = time.perf_counter()
    step = build()
    step()  # the first step compiles
    synchronize(args.device)
    first_step_s = time.perf_counter() - compile_start
    seconds = seconds_per_step(step, args)
    row = {
        "impl": name,
        "step_ms": round(seconds * 1e3, 2),
        "first_step_s": round(first_step_s, 3),
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if cuda else None,
    }
    print(f"  {name}: {json.dumps(row)}", flush=True)
    del step
    if cuda:
        torch.cuda.empty_cache()
    return row


def init_single_process_group(device: str) -> None:
    """A 1-process group, as a worker of a 1-GPU stage has (NCCL; gloo for a CPU smoke run)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    if device == "cpu":
        dist.init_process_group("gloo", rank=0, world_size=1)
        return
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))


def build_parser(description: str) -> argparse.ArgumentParser:
    """The flags of this benchmark (``bench/step_profiles.py`` adds its own to them)."""
    parser = argparse.ArgumentParser(description=description, allow_abbrev=False)
    parser.add_argument("--sizes", default="125m,350m,1.3b", help=f"comma list of {', '.join(SIZES)}")
    parser.add_argument("--mbs", default="8,16", help="comma list of micro-batch sizes")
    parser.add_argument(
        "--rows",
        default=None,
        metavar="SIZE:MBS,...",
        help="measure these rows, in this order (not sizes x mbs)",
    )
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=12, help="steps before timing (cover a measured step)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--compile-scope", choices=("auto", "model", "blocks"), default="auto")
    parser.add_argument(
        "--gns-overhead",
        action="store_true",
        help="time our step with GNS measured on every step / on the trainer's steps / off, no reference",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="JSON file for the rows (and profiles beside it)"
    )
    return parser


def parse_args(parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    parser = parser or build_parser(__doc__.splitlines()[0])
    args = parser.parse_args()
    if args.rows:
        args.row_list = [(size, int(mbs)) for size, mbs in (row.split(":") for row in args.rows.split(","))]
    else:
        mbs_list = [int(mbs) for mbs in args.mbs.split(",")]
        args.row_list = [(size, mbs) for size in args.sizes.split(",") for mbs in mbs_list]
    unknown = sorted({size for size, _ in args.row_list if size not in SIZES})
    if unknown:
        parser.error(f"unknown size {', '.join(unknown)} (known: {', '.join(SIZES)})")
    return args


def main() -> None:
    args = parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True  # as the reference does
    init_single_process_group(args.device)
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    print(f"device: {name}, torch {torch.__version__}", flush=True)
    rows = []
    for size, mbs in args.row_list:
        if args.gns_overhead:
            row = gns_overhead_row(size, mbs, args)
        else:
            flops_per_token = training_flops_per_token(engine_config(size, args.seq, False, args.device)[0])
            ref = measure("ref", partial(reference_step, size, mbs, args), args)
            ours = measure("ours", partial(engine_step, size, mbs, args), args)
            row = summarise(size, mbs, args.seq, ref, ours, flops_per_token)
        print(json.dumps(row), flush=True)
        rows.append(row)
        if args.out is not None:
            args.out.write_text(json.dumps(rows, indent=1) + "\n")
    if not args.gns_overhead:
        print_table(rows)
    dist.destroy_process_group()


def gns_overhead_row(size: str, mbs: int, args: argparse.Namespace) -> dict:
    """Our step time with the gradient-noise inputs off, measured every step, and on the trainer's steps."""
    times = {
        gns: measure(f"ours-gns-{gns}", partial(engine_step, size, mbs, args, gns), args)["step_ms"]
        for gns in ("off", "every", "trainer")
    }
    return {
        "size": size,
        "mbs": mbs,
        "seq": args.seq,
        "gns_off_step_ms": times["off"],
        "gns_every_step_ms": times["every"],
        "gns_trainer_step_ms": times["trainer"],
        "overhead_every_step": round(times["every"] / times["off"] - 1, 4),
        "overhead_trainer": round(times["trainer"] / times["off"] - 1, 4),
    }


def summarise(size: str, mbs: int, seq: int, ref: dict, ours: dict, flops_per_token: float) -> dict:
    tokens = mbs * seq
    ref_tps, ours_tps = tokens / (ref["step_ms"] / 1e3), tokens / (ours["step_ms"] / 1e3)
    return {
        "size": size,
        "mbs": mbs,
        "seq": seq,
        "ref_step_ms": ref["step_ms"],
        "ours_step_ms": ours["step_ms"],
        "ref_tok_s": round(ref_tps),
        "ours_tok_s": round(ours_tps),
        "ratio": round(ours_tps / ref_tps, 3),
        "ref_mfu": round(ref_tps * flops_per_token / (PEAK_BF16_TFLOPS * 1e12), 3),
        "ours_mfu": round(ours_tps * flops_per_token / (PEAK_BF16_TFLOPS * 1e12), 3),
        "ref_peak_gib": ref["peak_gib"],
        "ours_peak_gib": ours["peak_gib"],
        "ref_first_step_s": ref["first_step_s"],
        "ours_first_step_s": ours["first_step_s"],
    }


def print_table(rows: list[dict]) -> None:
    header = (
        f"{'size':>5} {'mbs':>4} {'ref tok/s':>10} {'ours tok/s':>10} {'ours/ref':>8} {'ref MFU':>7} "
        f"{'ours MFU':>8} {'ref GiB':>7} {'ours GiB':>8}"
    )
    print(header)
    for r in rows:
        print(
            f"{r['size']:>5} {r['mbs']:>4} {r['ref_tok_s']:>10,} {r['ours_tok_s']:>10,} {r['ratio']:>8.3f} "
            f"{r['ref_mfu']:>7.3f} {r['ours_mfu']:>8.3f} {r['ref_peak_gib']!s:>7} {r['ours_peak_gib']!s:>8}"
        )


if __name__ == "__main__":
    main()
