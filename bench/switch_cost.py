"""Cost of a strategy switch (a gbs change on one process), next to the cost of the same save and load alone.

THE SWITCH: a two-stage chain on one process, stage 1 at gbs G and stage 2 at gbs 2G (same layout, so only
the batch changes), run by the chain runner (:func:`cona.runner.schedules.chain_schedule.run_chain`, the
code behind ``cona train --chain``), with stage 2 in stage 1's worker processes as that command runs it
(``--restart-workers``: new processes for stage 2). The runner records the switch's split in
``runner_state.json``: save (stage 1's final checkpoint), publish (the universal copy), process start
(torchrun launch until the worker's imports are done; with reused processes, until they read the next
stage), load (mesh, model, optimizer, data, checkpoint) and first step (stage 2's first iteration).
Stage 1's own start-up (nothing to load) and stage 2's median step time are printed next to it, so the
part of ``load`` that is the checkpoint and the part of ``first step`` that is a warm-up show.

THE REFERENCE: in this process, without any restart, the same model and optimizer are built with the
engine's own functions under a one-process group, the switch's checkpoint is loaded into them (so the
optimizer state exists), then ``save_checkpoint`` and ``load_checkpoint`` are timed alone, several times.

It prints a row per measurement as it goes, then the ratios switch / (save + load alone). Random tokens in
a temporary indexed dataset (no demo data, no network)::

    PYTHONPATH=src python bench/switch_cost.py --device cpu --size tiny --repeats 3
    PYTHONPATH=src python bench/switch_cost.py --device cuda --size 350m --repeats 1 --ref-repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import cona
from cona.config.file import load_config
from cona.data.indexed import IndexedDatasetWriter
from cona.runner.run_dir import resolve_log_root
from cona.runner.schedules.chain_schedule import ChainRun, checkpoint_dtype, run_chain
from cona.runner.worker_session import stage_launcher

GPT2_VOCAB = 50257
# (layers, hidden, heads, default seq); tiny is the shape of examples/tiny/.conaconfig.
SIZES = {"tiny": (4, 64, 4, 128), "125m": (12, 768, 12, 1024), "350m": (24, 1024, 16, 1024)}
MIN_DOCUMENTS = 200
"""So that the 2% validation split (the worker builds its evaluation batches at start-up) is not empty."""
SWITCH_PARTS = ("save_s", "publish_s", "process_start_s", "load_s", "first_step_s")


@dataclass(frozen=True, kw_only=True)
class Setup:
    """Where one benchmark keeps its data, config and chain."""

    root: Path
    config_path: Path
    chain_path: Path


@dataclass(frozen=True, kw_only=True)
class SwitchMeasurement:
    """One chain run: the switch split, stage 1's start-up, stage 2's steady step, and the checkpoint."""

    split: dict[str, float]
    stage1_start: dict[str, float]
    stage2_median_step_s: float
    checkpoint: Path


def main() -> None:
    args = parse_args()
    setup = make_setup(args)
    print(
        f"switch cost: {args.size} (seq {args.seq}), device {args.device}, gbs {args.gbs} -> {2 * args.gbs}, "
        f"mbs {args.mbs}, {args.iters} iterations per stage, data and checkpoints in {setup.root}",
        flush=True,
    )
    switches = [measure_switch(setup, args, repeat) for repeat in range(args.repeats)]
    reference = measure_save_and_load(setup, args, switches[-1].checkpoint)
    summary = summarize(switches, reference)
    print_summary(summary)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(summary, indent=1) + "\n")
        print(f"wrote {args.json_out}")
    if not args.keep:
        shutil.rmtree(setup.root, ignore_errors=True)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--size", choices=tuple(SIZES), default="tiny")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default: per size)")
    parser.add_argument("--gbs", type=int, default=8, help="stage 1's global batch; stage 2 doubles it")
    parser.add_argument("--mbs", type=int, default=4)
    parser.add_argument("--iters", type=int, default=4, help="iterations of each stage")
    parser.add_argument("--repeats", type=int, default=3, help="chain runs (each measures one switch)")
    parser.add_argument("--ref-repeats", type=int, default=3, help="in-process save + load rounds")
    parser.add_argument("--workdir", type=Path, default=None, help="parent of the temporary directory")
    parser.add_argument("--json-out", default=None, help="also write the numbers to this JSON file")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    parser.add_argument(
        "--restart-workers",
        action="store_true",
        help="start new worker processes for stage 2 (as `cona train --restart-workers`); by default stage 2 "
        "runs in stage 1's processes, as `cona train --chain` does",
    )
    args = parser.parse_args()
    if args.seq is None:
        args.seq = SIZES[args.size][3]
    if args.gbs % args.mbs:
        parser.error(f"--gbs {args.gbs} must be a multiple of --mbs {args.mbs}")
    return args


# ----------------------------------------------------------------------------------------------- setup


def make_setup(args: argparse.Namespace) -> Setup:
    root = Path(tempfile.mkdtemp(prefix="cona-switch-", dir=args.workdir)).resolve()
    samples = args.iters * 3 * args.gbs  # stage 1 takes gbs, stage 2 twice that, per iteration
    write_random_tokens(root / "data" / "random", tokens=int(samples * args.seq * 1.5) + 64 * args.seq)
    config_path = root / ".conaconfig"
    config_path.write_text(json.dumps(bench_config(args), indent=1))
    chain_path = root / "chain.json"
    chain_path.write_text(json.dumps(gbs_change_chain(args), indent=1))
    # The workers are new processes: they must import this same cona, whatever the caller's cwd.
    source_root = str(Path(cona.__file__).resolve().parents[1])
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [source_root, os.environ.get("PYTHONPATH")]))
    return Setup(root=root, config_path=config_path, chain_path=chain_path)


def write_random_tokens(prefix: Path, *, tokens: int) -> None:
    """Documents of uniformly random GPT-2 token ids (step time does not depend on the text)."""
    rng = np.random.default_rng(0)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        while writer.num_tokens < tokens or writer.num_documents < MIN_DOCUMENTS:
            writer.add_document(rng.integers(0, GPT2_VOCAB, size=int(rng.integers(200, 2000))))


def bench_config(args: argparse.Namespace) -> dict:
    layers, hidden, heads, _ = SIZES[args.size]
    return {
        "model": {
            "name": f"gpt-{args.size}",
            "layers": layers,
            "hidden": hidden,
            "heads": heads,
            "seq": args.seq,
            "vocab_size": GPT2_VOCAB,
            "attention_dropout": 0.0,
            "hidden_dropout": 0.0,
        },
        "training": {
            "device": args.device,
            "dtype": "bf16" if args.device == "cuda" else "fp32",
            "base_gbs": args.gbs,
            "base_lr": 3e-4,
            "base_min_lr": 3e-5,
            "split": "98,2,0",
            "data_prefix": "data/random",
            "log_interval": 1,
            "eval_interval": 1_000_000,  # no evaluation: it is not part of a switch
            "eval_iters": 1,
            "log_root": "logs",
        },
    }


def gbs_change_chain(args: argparse.Namespace) -> dict:
    common = {"dp": 1, "tp": 1, "pp": 1, "mbs": args.mbs}
    return {
        "steps": [
            {**common, "step_num": 1, "gbs": args.gbs, "train_iters": args.iters, "is_initial": True,
             "convert": True},
            {**common, "step_num": 2, "gbs": 2 * args.gbs, "extra_iters": args.iters,
             "load_dp": 1, "load_tp": 1, "load_pp": 1},
        ]
    }  # fmt: skip


def free_port_base(stages: int) -> int:
    """A base port whose stage ports (base + 1 ... base + stages) are all free right now."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            base = sock.getsockname()[1] - 1
        if base + stages <= 65535 and all(_port_free(base + stage) for stage in range(1, stages + 1)):
            return base


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


# ------------------------------------------------------------------------------------------ the switch


def measure_switch(setup: Setup, args: argparse.Namespace, repeat: int) -> SwitchMeasurement:
    """Run the two-stage chain once (its own workdir and run directory) and read what the runner recorded."""
    config = resolve_log_root(load_config(setup.config_path, check_data_files=True))
    run = ChainRun(
        chain_path=setup.chain_path,
        config=config,
        workdir=setup.root / f"work{repeat}",
        run_dir=Path(config.training.logging.log_root) / f"switch{repeat}",
        world_size=1,
        device_type=args.device,
        base_port=free_port_base(stages=2),
        quiet=True,
    )
    with stage_launcher(restart_workers=args.restart_workers) as launcher:
        state = run_chain(run, launcher=launcher, out=lambda line: print(f"  runner: {line}", flush=True))
    stage1, stage2 = state.stages
    metrics = [json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    records = [record for record in metrics if record["stage"] == 2]
    steady = statistics.median(record["step_time_s"] for record in records[1:]) if len(records) > 1 else 0.0
    measurement = SwitchMeasurement(
        split=dict(stage2.switch_cost),
        stage1_start={key: stage1.timings[key] for key in ("process_start_s", "load_s", "first_step_s")},
        stage2_median_step_s=steady,
        checkpoint=Path(stage1.checkpoint),
    )
    parts = ", ".join(f"{_label(key)} {measurement.split[key]:.2f}" for key in SWITCH_PARTS)
    print(
        f"switch run {repeat + 1}: {parts}; total {sum(measurement.split.values()):.2f} s | stage 1 start: "
        f"process start {measurement.stage1_start['process_start_s']:.2f}, load (no checkpoint) "
        f"{measurement.stage1_start['load_s']:.2f}, first step {measurement.stage1_start['first_step_s']:.2f}"
        f" | stage 2 median step {steady:.3f} s",
        flush=True,
    )
    return measurement


def _label(key: str) -> str:
    return key.removesuffix("_s").replace("_", " ")


# --------------------------------------------------------------------------------------- the reference


def measure_save_and_load(setup: Setup, args: argparse.Namespace, checkpoint: Path) -> dict[str, list[float]]:
    """Build the stage-2 model and optimizer in this process and time save and load of the switch's
    checkpoint, ``args.ref_repeats`` times each, without restarting anything."""
    import torch

    from cona.engine.checkpoint.load import load_checkpoint
    from cona.engine.checkpoint.save import save_checkpoint
    from cona.engine.optim import build_optimizer
    from cona.engine.parallel_dims import build_mesh
    from cona.engine.train_model import build_training_model
    from cona.runner.chain_file import load_chain

    config = resolve_log_root(load_config(setup.config_path, check_data_files=True))
    chain = load_chain(
        setup.chain_path,
        config=config,
        world_size=1,
        dtype=checkpoint_dtype(config.training, args.device),
        workdir=setup.root,
    )
    strategy = chain.steps[1].strategy(config)
    device = init_single_process_group(args.device)
    began = time.perf_counter()
    model = build_training_model(config, strategy, build_mesh(strategy, device.type), device)
    optimizer = build_optimizer(model.model_parts, config.training)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    print(f"reference: model and optimizer built in this process in {time.perf_counter() - began:.2f} s")

    def load() -> dict:
        return load_checkpoint(checkpoint, model_parts=model.model_parts, optimizer=optimizer, config=config)

    trainer_state, _ = timed(load, sync)  # the first load creates the optimizer state; not counted
    layout = setup.root / "reference" / strategy.layout
    times: dict[str, list[float]] = {"save_s": [], "load_s": []}
    for round_ in range(args.ref_repeats):
        saved, save_s = timed(
            lambda: save_checkpoint(
                layout,
                iteration=trainer_state["iteration"],
                model_parts=model.model_parts,
                optimizer=optimizer,
                trainer_state=trainer_state,
                config=config,
                strategy=strategy,
            ),
            sync,
        )
        _, load_s = timed(load, sync)
        times["save_s"].append(save_s)
        times["load_s"].append(load_s)
        shutil.rmtree(saved)  # outside the timed part: the next round writes a fresh directory
        print(f"reference round {round_ + 1}: save {save_s:.2f} s, load {load_s:.2f} s", flush=True)
    return times


def init_single_process_group(device_type: str):
    """A one-process group (gloo on CPU, NCCL on CUDA), as the worker of a one-process stage has."""
    import torch
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port_base(stages=1) + 1))
    if device_type == "cuda":
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
        return device
    dist.init_process_group("gloo", rank=0, world_size=1)
    return torch.device("cpu")


def timed(work: Callable[[], object], sync: Callable[[], None]) -> tuple[object, float]:
    sync()
    began = time.perf_counter()
    result = work()
    sync()
    return result, time.perf_counter() - began


# ---------------------------------------------------------------------------------------------- report


def summarize(switches: list[SwitchMeasurement], reference: dict[str, list[float]]) -> dict:
    """Medians over the runs and rounds, and the ratios of the switch's parts to save/load alone."""
    split = {key: statistics.median(s.split[key] for s in switches) for key in SWITCH_PARTS}
    stage1 = {
        key: statistics.median(s.stage1_start[key] for s in switches) for key in switches[0].stage1_start
    }
    ref = {key: statistics.median(values) for key, values in reference.items()}
    total = sum(split.values())
    alone = ref["save_s"] + ref["load_s"]
    return {
        "switch_s": split,
        "switch_total_s": total,
        "stage1_start_s": stage1,
        "stage2_median_step_s": statistics.median(s.stage2_median_step_s for s in switches),
        "alone_s": ref,
        "alone_total_s": alone,
        "ratios": {
            "switch_total / (save + load alone)": total / alone,
            "switch save / save alone": split["save_s"] / ref["save_s"],
            "switch load / load alone": split["load_s"] / ref["load_s"],
            "(switch load - stage 1 load) / load alone": (split["load_s"] - stage1["load_s"]) / ref["load_s"],
        },
        "runs": len(switches),
        "reference_rounds": len(reference["save_s"]),
    }


def print_summary(summary: dict) -> None:
    split, ref = summary["switch_s"], summary["alone_s"]
    print(
        f"\nmedians over {summary['runs']} switch run(s) and {summary['reference_rounds']} reference round(s)"
    )
    print(f"{'part':<16}{'switch s':>10}{'alone s':>10}")
    for key in SWITCH_PARTS:
        alone = f"{ref[key]:.2f}" if key in ref else "-"
        print(f"{_label(key):<16}{split[key]:>10.2f}{alone:>10}")
    print(f"{'total':<16}{summary['switch_total_s']:>10.2f}{summary['alone_total_s']:>10.2f}")
    print(
        f"stage 1 (no checkpoint): process start {summary['stage1_start_s']['process_start_s']:.2f} s, "
        f"load {summary['stage1_start_s']['load_s']:.2f} s, first step "
        f"{summary['stage1_start_s']['first_step_s']:.2f} s; stage 2 median step "
        f"{summary['stage2_median_step_s']:.3f} s"
    )
    for name, ratio in summary["ratios"].items():
        print(f"{name}: {ratio:.2f}")


if __name__ == "__main__":
    main()
