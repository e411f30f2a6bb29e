"""How long ``cona train`` takes from launch until its runner has planned the first stage, fixed and online.

That is the runner's own start (its imports and, online, its initial search); the workers' start follows and
is the same code in every mode. Each round launches a one-stage chain and an online run of a tiny GPT on the
bench corpus (a few iterations each), and, as the reference measured in the same round, a bare
``python -c "import torch"``: the runner imports no torch, so its start should come out under that import.
From the repository root (``bench/corpus.py`` builds ``data/bench`` first)::

    PYTHONPATH=src .venv/bin/python bench/runner_start.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PROJECT_ROOT = Path(__file__).resolve().parents[1]
MODES = ("fixed", "online")
TINY_MODEL = {"name": "tiny", "layers": 2, "hidden": 64, "heads": 2, "seq": 64}
ITERATIONS = 4


def run_config(data_dir: Path, run_root: Path, device: str) -> dict[str, Any]:
    """A tiny GPT's .conaconfig on the bench corpus, its cache and logs under ``run_root``."""
    training = {
        "device": device,
        "dtype": "fp32" if device == "cpu" else "bf16",
        "compile": False,
        "base_gbs": 2,
        "base_lr": 4e-4,
        "data_prefix": str(data_dir / "bench_text_document"),
        "vocab_file": str(data_dir / "gpt2-vocab.json"),
        "merge_file": str(data_dir / "gpt2-merges.txt"),
        "tokenizer_type": "GPT2BPETokenizer",
        "data_cache_path": str(run_root / "index-cache"),
        "log_root": str(run_root / "logs"),
        "log_interval": 2,
        "wandb_mode": "disabled",
    }
    return {"model": TINY_MODEL, "training": training}


def command(mode: str, run_root: Path, system: str) -> list[str]:
    """The ``cona train`` command of one mode; its config (and chain) are in ``run_root``."""
    base = [sys.executable, "-m", "cona", "train", "--config", str(run_root / ".conaconfig")]
    base += ["--workdir", str(run_root), "--run-name", mode, "--gpus", "1", "--quiet"]
    if mode == "fixed":
        return [*base, "--chain", str(run_root / "chain.json")]
    tokens = ITERATIONS * 2 * TINY_MODEL["seq"]
    return [*base, "--system", system, "--initial-gbs", "2", "--max-gbs", "4", "--total-tokens", str(tokens)]


def prepare(work_dir: Path, data_dir: Path, device: str) -> None:
    """Each mode's folder with its .conaconfig; the fixed one's one-stage chain."""
    for mode in MODES:
        run_root = work_dir / mode
        run_root.mkdir(parents=True, exist_ok=True)
        (run_root / ".conaconfig").write_text(json.dumps(run_config(data_dir, run_root, device)))
    step = {"step_num": 1, "dp": 1, "tp": 1, "pp": 1, "gbs": 2, "mbs": 2, "train_iters": ITERATIONS}
    (work_dir / "fixed" / "chain.json").write_text(json.dumps({"steps": [{**step, "is_initial": True}]}))


def planned_after(run_dir: Path, launched: float) -> float:
    """Seconds from ``launched`` until the run's first stage was planned (``runner_state.json``)."""
    state = json.loads((run_dir / "runner_state.json").read_text())
    return float(state["stages"][0]["planned_at"]) - launched


def timed(args: list[str], cwd: Path) -> float:
    """Wall seconds of a command that must succeed (its output is kept back and shown if it fails)."""
    start = time.time()
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(args)} failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    return time.time() - start


def one_round(work_dir: Path, system: str) -> dict[str, float]:
    """The torch import and each mode's runner start, once (every run from scratch)."""
    times = {"import torch": timed([sys.executable, "-c", "import torch"], PROJECT_ROOT)}
    for mode in MODES:
        run_root = work_dir / mode
        for leftover in ("logs", "checkpoints"):
            shutil.rmtree(run_root / leftover, ignore_errors=True)
        launched = time.time()
        timed(command(mode, run_root, system), PROJECT_ROOT)
        times[mode] = planned_after(run_root / "logs" / mode, launched)
    return times


def summary(rounds: list[dict[str, float]]) -> list[str]:
    """One line per measured thing: median, min and max over the rounds, and the median over the torch
    import's median."""
    reference = statistics.median(r["import torch"] for r in rounds)
    lines = []
    for name in rounds[0]:
        values = [r[name] for r in rounds]
        lines.append(
            f"{name:>12}: median {statistics.median(values):6.2f} s (min {min(values):.2f}, max "
            f"{max(values):.2f}; {statistics.median(values) / reference:.2f}x the torch import)"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--system", default="cpu_gloo", help="online mode's --system")
    parser.add_argument("--data-dir", type=Path, default=PROJECT_ROOT / "data" / "bench")
    parser.add_argument("--work-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="runner-start-"))
    prepare(work_dir, args.data_dir.resolve(), args.device)
    rounds = [one_round(work_dir, args.system) for _ in range(args.rounds)]
    print(f"runner start (launch to the first stage's plan), {args.rounds} rounds, {args.device}:")
    print("\n".join(summary(rounds)))


if __name__ == "__main__":
    main()
