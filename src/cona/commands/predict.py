"""``cona predict``: one strategy's predicted iteration time and memory per GPU on a system."""

from __future__ import annotations

import argparse
import json

from cona.commands.config_flags import add_config_flags
from cona.config import RECOMPUTE, TrainingConfig
from cona.config.file import load_config
from cona.errors import UsageError
from cona.planner.perf_model import Prediction, predict
from cona.planner.profiles import BACKENDS
from cona.planner.systems import System, load_system
from cona.strategy import Strategy

TIME_KEYS = (
    "iteration_time_s",
    "compute_s",
    "tp_comm_s",
    "pp_bubble_s",
    "pp_p2p_s",
    "dp_comm_exposed_s",
    "optimizer_s",
    "overhead_s",
    "host_bound_s",
)
MEMORY_KEYS = ("memory_gib", "weights_gib", "grads_gib", "optimizer_gib", "activations_gib")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "predict",
        help="Predict one strategy's iteration time and memory per GPU",
        description="Predict one strategy's iteration time (split into compute, communication, pipeline "
        "bubble, optimizer) and memory per GPU for the model of a .conaconfig on a system.",
    )
    parser.add_argument(
        "--system", required=True, help="system name (cona systems lists them) or a system JSON file"
    )
    for flag, text in (
        ("--dp", "data-parallel degree"),
        ("--tp", "tensor-parallel degree"),
        ("--pp", "pipeline-parallel degree"),
        ("--mbs", "micro-batch size (samples)"),
        ("--gbs", "global batch size (samples)"),
    ):
        parser.add_argument(flag, type=int, required=True, help=text)
    parser.add_argument(
        "--zero-stage",
        type=int,
        default=None,
        choices=(0, 1, 2, 3),
        help="ZeRO/FSDP stage (default: training.zero_stage)",
    )
    parser.add_argument(
        "--recompute",
        choices=RECOMPUTE,
        default=None,
        help="activation recomputation (default: training.recompute)",
    )
    parser.add_argument("--sequence-parallel", action="store_true", help="shard norms and dropout over tp")
    parser.add_argument(
        "--interleave",
        type=int,
        default=None,
        metavar="V",
        help="virtual pipeline stages per rank, interleaved 1F1B when > 1 (default: the config's)",
    )
    parser.add_argument(
        "--gpipe", action="store_true", help="GPipe schedule (default: the config's schedule)"
    )
    parser.add_argument(
        "--dtype",
        choices=("bf16", "fp16", "fp32"),
        default=None,
        help="training precision (default: training.dtype)",
    )
    add_config_flags(parser)
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default="native",
        help="the backend whose profile predicts the step: native (default) or megatron-deepspeed",
    )
    parser.add_argument("--json", action="store_true", help="print one flat JSON object")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    config = load_config(args.config, overrides=args.overrides)
    system = load_system(args.system)
    strategy = _strategy(args, config.training)
    dtype = args.dtype or config.training.runtime.dtype
    prediction = predict(config.model, strategy, system, dtype=dtype, backend=args.backend)
    if args.json:
        print(json.dumps(_flat(prediction, strategy, system, system.resolve_dtype(dtype), args.backend)))
    else:
        _print_table(prediction, strategy, system)
    return 0


def _strategy(args: argparse.Namespace, training: TrainingConfig) -> Strategy:
    """The flags' strategy; what the flags leave out comes from the config's training section."""
    if args.interleave is not None and args.interleave < 1:
        raise UsageError(f"--interleave: {args.interleave} must be at least 1")
    virtual_stages = (
        args.interleave if args.interleave is not None else training.runtime.pipeline_virtual_stages
    )
    if args.gpipe and virtual_stages > 1:
        raise UsageError("--gpipe cannot be combined with interleaving (--interleave or the config's stages)")
    if args.gpipe:
        schedule = "gpipe"
    elif args.interleave is not None:
        schedule = "interleaved_1f1b" if virtual_stages > 1 else "1f1b"
    else:
        schedule = training.runtime.pipeline_schedule
    return Strategy(
        dp=args.dp,
        tp=args.tp,
        pp=args.pp,
        mbs=args.mbs,
        gbs=args.gbs,
        zero_stage=args.zero_stage if args.zero_stage is not None else training.runtime.zero_stage,
        recompute=args.recompute or training.runtime.recompute,
        sequence_parallel=args.sequence_parallel or training.runtime.sequence_parallel,
        pipeline_schedule=schedule,
        virtual_stages=virtual_stages,
    )


def _flat(prediction: Prediction, strategy: Strategy, system: System, dtype: str, backend: str) -> dict:
    row = prediction.row(0)
    flat = {
        "system": system.name,
        "backend": backend,
        "dtype": dtype,
        "dp": strategy.dp,
        "tp": strategy.tp,
        "pp": strategy.pp,
        "mbs": strategy.mbs,
        "gbs": strategy.gbs,
        "zero_stage": strategy.zero_stage,
        "recompute": strategy.recompute,
        "sequence_parallel": strategy.sequence_parallel,
        "pipeline_schedule": strategy.pipeline_schedule,
        "virtual_stages": strategy.virtual_stages,
    }
    flat.update({key: row[key] for key in TIME_KEYS})
    flat["memory_per_gpu_gib"] = row["memory_gib"]
    flat.update({key: row[key] for key in MEMORY_KEYS[1:]})
    flat.update(reserved_gib=system.gpu.reserved_gib, gpu_memory_gib=system.gpu.memory_gib)
    flat.update(oom=row["oom"], tokens_per_s=row["tokens_per_s"])
    return flat


def _print_table(prediction: Prediction, strategy: Strategy, system: System) -> None:
    from rich.console import Console
    from rich.table import Table

    row = prediction.row(0)
    row.update(reserved_gib=system.gpu.reserved_gib, gpu_memory_gib=system.gpu.memory_gib)
    table = Table(title=f"{strategy.short()} on {system.name}", show_header=True)
    table.add_column("iteration time", justify="left")
    table.add_column("s", justify="right")
    table.add_column("memory per GPU", justify="left")
    table.add_column("GiB", justify="right")
    memory_keys = (*MEMORY_KEYS, "reserved_gib", "gpu_memory_gib", "", "")
    for time_key, memory_key in zip(TIME_KEYS, memory_keys, strict=True):
        table.add_row(
            time_key.removesuffix("_s"),
            f"{row[time_key]:.4g}",
            memory_key.removesuffix("_gib"),
            f"{row[memory_key]:.2f}" if memory_key else "",
        )
    console = Console()
    console.print(table)
    fits = "OUT OF MEMORY" if row["oom"] else "fits"
    console.print(f"{row['tokens_per_s']:,.0f} tokens/s; {fits}")
