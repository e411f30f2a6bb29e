"""Measured statistical curves: fixed-gbs runs of one model on one device, eval loss against tokens.

Each gbs of ``--gbs`` trains as its own ``cona train --chain`` subprocess of one step (dp = tp = pp = 1;
gradient accumulation makes any gbs possible on one device, and the tokens a gbs needs to a loss do not
depend on the hardware), from the same initialisation, with the online time-to-target runs' seed, LR rule
(sqrt scaling from base gbs 8 at 4e-4), LR warm-up (1.31M tokens) and token-based decay horizon (32M
tokens), and the same evaluation set (64 samples) every 262,144 tokens. A run trains ``--tokens`` tokens;
its ``metrics.jsonl`` gives the eval loss at each evaluation and the noise scale the run's tracker reported
there (:func:`cona.planner.trace.read_trace`, as online mode's tracker reads it). The curves file
(:mod:`cona.planner.curves`; ``cona plan --curves``) is rewritten after every run, so a run cut short by
the budget keeps the evaluations it made and every earlier run is kept.

The plan (tokens, iterations, micro-batch, estimated seconds per run) is printed before anything runs: the
estimate is ``START_S`` of start-up and compile per run plus the tokens at ``TOKENS_PER_S`` (GPT-125M,
seq 512, bf16, compiled, on one H100 or H200). With the defaults (six runs, 14M tokens each) it is about
8 minutes; ``--budget-s`` (520 s) is shared among the runs by their estimates, and a run is stopped at its
share (its evaluations so far are kept), so a slower device shortens every curve alike.

GPU, one H100 (from the repository root, ``data/bench`` carried; ~8.5 minutes)::

    PYTHONPATH=src timeout 590 python3 bench/stat_curves.py --corpus bench --out $OUT/curves-125m.json

The largest batches need the most tokens to reach a low loss; they can train longer in a call of their own
and the files be merged (``--merge A.json B.json --out C.json``)::

    PYTHONPATH=src timeout 590 python3 bench/stat_curves.py --corpus bench --gbs 256,512 --tokens 30000000 \
        --out $OUT/curves-125m-large.json

CPU smoke (a tiny GPT on the demo text, two runs, about a minute on a loaded 2-core machine)::

    PYTHONPATH=src .venv/bin/python bench/stat_curves.py --smoke --out /tmp/curves.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROJECT_ROOT = Path(__file__).resolve().parents[1]
START_S = 35.0
"""Seconds a run spends before its first training step (process start, data index, torch.compile)."""
TOKENS_PER_S = 330_000.0
"""GPT-125M's training rate on one H100 at these batches (the H200's measured ~400k, less ~15%)."""
MAX_MBS = 32
"""The largest micro-batch: 32 x 512 tokens fits GPT-125M's activations on one 80 GB GPU many times over."""


@dataclass(frozen=True, kw_only=True)
class Setup:
    """One model on one corpus and the schedule every run shares."""

    model: dict[str, Any]
    data: tuple[str, str, str]
    """Data folder (under the project root), dataset name, tokenizer prefix (``gpt2`` or ``tiny``)."""
    device: str
    base_gbs: int
    base_lr: float
    base_min_lr: float
    warmup_tokens: int
    decay_tokens: int
    eval_every_tokens: int
    eval_samples: int
    gbs: tuple[int, ...]
    tokens: int
    max_mbs: int = MAX_MBS


_GPT_125M = {"name": "gpt-125m", "layers": 12, "hidden": 768, "heads": 12, "seq": 512}
SETUPS = {
    "bench": Setup(
        model=_GPT_125M, data=("data/bench", "bench_text_document", "gpt2"), device="cuda", base_gbs=8,
        base_lr=4e-4, base_min_lr=4e-5, warmup_tokens=1_310_720, decay_tokens=32_000_000,
        eval_every_tokens=262_144, eval_samples=64, gbs=(16, 32, 64, 128, 256, 512), tokens=14_000_000,
    ),
    "demo": Setup(
        model=_GPT_125M, data=("data/demo", "wiki_text_document", "gpt2"), device="cuda", base_gbs=8,
        base_lr=4e-4, base_min_lr=4e-5, warmup_tokens=1_310_720, decay_tokens=32_000_000,
        eval_every_tokens=262_144, eval_samples=64, gbs=(16, 32, 64, 128, 256, 512), tokens=14_000_000,
    ),
    "smoke": Setup(
        model={"name": "gpt-tiny", "layers": 2, "hidden": 32, "heads": 2, "seq": 32, "attention_dropout": 0.0,
               "hidden_dropout": 0.0},
        data=("data/demo", "wiki_tiny_text_document", "tiny"), device="cpu", base_gbs=2, base_lr=2e-3,
        base_min_lr=2e-4, warmup_tokens=64, decay_tokens=8_192, eval_every_tokens=256, eval_samples=8,
        gbs=(2, 4), tokens=1_024, max_mbs=4,
    ),
}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, Setup]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--corpus", choices=("bench", "demo"), default="bench",
        help="GPT-125M on data/bench (demo: on the 1M-token demo text, for a timing check)",
    )  # fmt: skip
    parser.add_argument("--smoke", action="store_true", help="a tiny GPT on the demo text, on the CPU")
    parser.add_argument(
        "--out", type=Path, required=True, help="the curves file (JSON), written after each run"
    )
    parser.add_argument("--gbs", default=None, help="comma list of global batch sizes (default 16,...,512)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per run (default 14M)")
    parser.add_argument(
        "--budget-s", type=float, default=520.0, help="seconds for all runs, shared by their estimates"
    )
    parser.add_argument("--work-dir", default=None, help="where the runs go (default: a temporary directory)")
    parser.add_argument("--data-dir", default=None, help="default: the corpus's folder")
    args = parser.parse_args(argv)
    setup = SETUPS["smoke" if args.smoke else args.corpus]
    if args.gbs:
        try:
            sizes = tuple(sorted({int(part) for part in args.gbs.split(",")}))
        except ValueError:
            parser.error(f"--gbs: {args.gbs!r} is not a comma list of integers")
        if min(sizes) < 1:
            parser.error("--gbs: sizes must be positive")
        setup = _replace(setup, gbs=sizes)
    if args.tokens is not None:
        if args.tokens < max(setup.gbs) * setup.model["seq"]:
            parser.error(f"--tokens: {args.tokens} is less than one step of gbs {max(setup.gbs)}")
        setup = _replace(setup, tokens=args.tokens)
    data_dir = Path(args.data_dir) if args.data_dir else PROJECT_ROOT / setup.data[0]
    if not (data_dir / f"{setup.data[1]}.bin").is_file():
        parser.error(
            f"--data-dir: {data_dir / setup.data[1]}.bin does not exist (bench/corpus.py builds data/bench)"
        )
    args.data_dir = data_dir
    return args, setup


def _replace(setup: Setup, **changes: Any) -> Setup:
    return Setup(**{**setup.__dict__, **changes})


def plan_rows(setup: Setup) -> list[dict[str, Any]]:
    """Per gbs: micro-batch, iterations, tokens and estimated seconds (start-up plus training)."""
    seq, rows = setup.model["seq"], []
    for gbs in setup.gbs:
        iterations = math.ceil(setup.tokens / (gbs * seq))
        tokens = iterations * gbs * seq
        rows.append({"gbs": gbs, "mbs": _mbs(gbs, setup), "iterations": iterations, "tokens": tokens,
                     "estimated_s": START_S + tokens / TOKENS_PER_S})  # fmt: skip
    return rows


def _mbs(gbs: int, setup: Setup) -> int:
    """The largest power of two up to ``max_mbs`` dividing both the gbs and the evaluation set."""
    mbs = 1
    while mbs * 2 <= setup.max_mbs and gbs % (mbs * 2) == 0 and setup.eval_samples % (mbs * 2) == 0:
        mbs *= 2
    return mbs


def conaconfig(setup: Setup, data_dir: Path, root: Path, gbs: int) -> dict[str, Any]:
    seq = setup.model["seq"]
    vocab = "gpt2" if setup.data[2] == "gpt2" else "tiny"
    interval = max(1, round(setup.eval_every_tokens / (gbs * seq)))
    training = {
        "seed": 1234, "device": setup.device, "dtype": "bf16" if setup.device == "cuda" else "fp32",
        "zero_stage": 1, "compile": setup.device == "cuda", "base_gbs": setup.base_gbs,
        "base_lr": setup.base_lr, "base_min_lr": setup.base_min_lr, "lr_scale_strategy": "sqrt",
        "lr_warmup_tokens": setup.warmup_tokens, "lr_decay_tokens": setup.decay_tokens, "weight_decay": 0.1,
        "split": "949,50,1", "data_prefix": str(data_dir.resolve() / setup.data[1]),
        "vocab_file": str(data_dir.resolve() / f"{vocab}-vocab.json"),
        "merge_file": str(data_dir.resolve() / f"{vocab}-merges.txt"), "tokenizer_type": "GPT2BPETokenizer",
        "data_cache_path": str(root / "index-cache"), "log_interval": min(8, interval),
        "eval_interval": interval, "eval_every_tokens": setup.eval_every_tokens,
        "eval_iters": setup.eval_samples // setup.base_gbs, "log_root": str(root / "logs"),
        "wandb_mode": "disabled",
    }  # fmt: skip
    return {"model": dict(setup.model), "training": training}


def run_one(setup: Setup, row: dict[str, Any], data_dir: Path, work: Path, deadline: float) -> Path:
    """Train one gbs; returns its metrics.jsonl (stopped at ``deadline``, what it logged is kept)."""
    gbs, root = row["gbs"], work / f"gbs{row['gbs']}"
    root.mkdir(parents=True)
    (root / ".conaconfig").write_text(json.dumps(conaconfig(setup, data_dir, root, gbs)))
    step = {"step_num": 1, "dp": 1, "tp": 1, "pp": 1, "gbs": gbs, "mbs": row["mbs"],
            "train_iters": row["iterations"], "is_initial": True, "convert": False}  # fmt: skip
    (root / "chain.json").write_text(json.dumps({"steps": [step]}))
    name = f"gbs{gbs}"
    command = [sys.executable, "-m", "cona", "train", "--config", str(root / ".conaconfig"), "--chain",
               str(root / "chain.json"), "--gpus", "1", "--workdir", str(root), "--run-name", name,
               "--quiet"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT / "src")}
    process = subprocess.Popen(command, cwd=root, env=env, start_new_session=True)
    try:
        process.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        print(f"gbs {gbs}: budget spent, stopped; its evaluations so far are kept", flush=True)
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return root / "logs" / name / "metrics.jsonl"


def curve_of(metrics: Path, gbs: int, base_gbs: int) -> dict[str, Any] | None:
    """The run's curve: eval loss and the tracker's noise scale at each evaluation (None: no evaluation)."""
    import numpy as np

    from cona.config import TrainingConfig
    from cona.errors import PlanError
    from cona.planner.trace import read_trace

    try:
        trace = read_trace(metrics, training=TrainingConfig(base_gbs=base_gbs))
    except PlanError as error:
        print(f"gbs {gbs}: no curve ({error})", flush=True)
        return None
    if trace.loss_kind != "eval_loss":
        print(f"gbs {gbs}: no evaluation logged", flush=True)
        return None
    noise = []
    for tokens in trace.loss_tokens:
        seen = np.flatnonzero(trace.tokens <= tokens)
        estimate = trace.estimate(int(seen[-1])) if seen.size else None
        noise.append(None if estimate is None else estimate.noise_scale)
    for strategy, step_s in trace.timed:
        print(f"gbs {gbs}: median step {step_s:.3f} s ({strategy.short()})", flush=True)
    return {
        "gbs": gbs,
        "tokens": trace.loss_tokens.tolist(),
        "eval_loss": trace.loss.tolist(),
        "noise_scale": noise,
    }


def run_deadline(remaining: list[dict[str, Any]], now: float, deadline: float) -> float:
    """When the first of ``remaining`` runs is stopped: its estimated share of the budget left, so a device
    slower than the estimate shortens every curve alike rather than dropping the last gbs."""
    share = remaining[0]["estimated_s"] / sum(row["estimated_s"] for row in remaining)
    return now + max(deadline - now, 0.0) * share


def write_curves(out: Path, setup: Setup, curves: list[dict[str, Any]], recorded: dict[str, Any]) -> None:
    from cona.planner.curves import curves_json

    model = {**setup.model, "vocab_size": 50304} if setup.data[2] == "gpt2" else dict(setup.model)
    content = curves_json(model, setup.base_gbs, curves, synthetic=False, recorded=recorded)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(content, indent=1) + "\n")


def device_name(setup: Setup) -> str:
    if setup.device != "cuda":
        return "cpu"
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cuda (not available)"


def merge(paths: list[Path], out: Path) -> int:
    """One curves file from several calls' (e.g. the large gbs trained longer in a call of their own): the
    model and base gbs must agree; a gbs in several files is an error."""
    from cona.errors import PlanError
    from cona.planner.curves import curves_json, load_curves

    try:
        loaded = [load_curves(path) for path in paths]
    except PlanError as error:
        raise SystemExit(f"--merge: {error}") from None
    first = loaded[0]
    for other in loaded[1:]:
        if (other.model, other.base_gbs) != (first.model, first.base_gbs):
            raise SystemExit(f"--merge: {other.source} has another model or base gbs than {first.source}")
    gbs = [g for curves in loaded for g in curves.gbs]
    if len(set(gbs)) != len(gbs):
        raise SystemExit(f"--merge: a gbs is in more than one file ({sorted(gbs)})")
    raws = [json.loads(Path(path).read_text()) for path in paths]
    content = curves_json(
        raws[0]["model"], first.base_gbs, [c for raw in raws for c in raw["curves"]],
        synthetic=any(curves.synthetic for curves in loaded),
        recorded={"merged": [raw["recorded"] for raw in raws]},
    )  # fmt: skip
    out.write_text(json.dumps(content, indent=1) + "\n")
    print(f"merged {len(gbs)} curves from {len(paths)} files into {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "--merge":
        *sources, flag, out = argv[1:]
        if flag != "--out" or not sources:
            raise SystemExit("usage: stat_curves.py --merge A.json B.json ... --out C.json")
        return merge([Path(s) for s in sources], Path(out))
    args, setup = parse_args(argv)
    rows = plan_rows(setup)
    runs = f"{len(rows)} runs of {setup.tokens:,} tokens"
    print(f"plan: {setup.model['name']}, {runs}, budget {args.budget_s:.0f} s")
    for row in rows:
        print(f"  gbs {row['gbs']:4d}  mbs {row['mbs']:3d}  {row['iterations']:6d} iterations  "
              f"{row['tokens']:>12,} tokens  ~{row['estimated_s']:.0f} s")  # fmt: skip
    print(f"  estimated total ~{sum(row['estimated_s'] for row in rows):.0f} s", flush=True)
    recorded = {
        "card": device_name(setup),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "bench/stat_curves.py " + " ".join(argv),
        "tokens_per_run": setup.tokens, "lr": {"base_lr": setup.base_lr, "rule": "sqrt", "warmup_tokens":
        setup.warmup_tokens, "decay_tokens": setup.decay_tokens}, "seed": 1234,
    }  # fmt: skip
    deadline = time.monotonic() + args.budget_s
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="stat-curves-"))
    curves = []
    for index, row in enumerate(rows):
        started = time.monotonic()
        metrics = run_one(setup, row, args.data_dir, work, run_deadline(rows[index:], started, deadline))
        curve = curve_of(metrics, row["gbs"], setup.base_gbs) if metrics.is_file() else None
        if curve is not None:
            curves.append(curve)
            write_curves(args.out, setup, curves, recorded)
            last = f"last eval loss {curve['eval_loss'][-1]:.4f} at {curve['tokens'][-1]:,.0f} tokens"
            took = f"{time.monotonic() - started:.0f} s"
            print(f"gbs {row['gbs']}: {len(curve['tokens'])} evaluations, {last}, {took}", flush=True)
    if not curves:
        print("no curve was recorded", file=sys.stderr)
        return 1
    print(f"wrote {len(curves)} curves to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
