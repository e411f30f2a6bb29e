"""``cona strategies``: rank the valid parallel strategies of the config's model for N GPUs at one gbs."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import TYPE_CHECKING

import numpy as np

from cona.commands.config_flags import add_config_flags
from cona.commands.flag_types import seed_value
from cona.commands.search_flags import add_search_flags, botorch_choice
from cona.config.file import load_config
from cona.errors import UsageError
from cona.planner.profiles import BACKENDS, run_profile
from cona.strategy import Strategy

if TYPE_CHECKING:
    from cona.planner.search import SearchResult

TIE = 0.001
"""Relative time difference under which two strategies count as equally fast in the explanation."""
EXPLAIN_POOL = 200
"""Ranked strategies kept for the explanation under the table (the best other layout is among them)."""
TIME_TERMS = (
    ("compute_s", "compute"),
    ("tp_comm_s", "TP comm"),
    ("pp_bubble_s", "bubble"),
    ("pp_p2p_s", "PP p2p"),
    ("dp_comm_exposed_s", "DP comm"),
    ("optimizer_s", "optimizer"),
    ("overhead_s", "overhead"),
    ("host_bound_s", "host"),
)
"""The parts of the predicted iteration time, as (Prediction field, column heading); they sum to it."""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "strategies",
        help="Rank the valid parallel strategies for a GPU count and global batch",
        description="Rank the valid parallel strategies (dp, tp, pp, mbs, ZeRO stage, recompute, sequence "
        "parallelism, interleaving) of the .conaconfig model for N GPUs at one global batch size, "
        "by predicted iteration time, with the time split and memory of each.",
    )
    parser.add_argument("--gpus", type=int, required=True, help="number of GPUs")
    parser.add_argument(
        "--system", required=True, help="system name (cona systems lists them) or system JSON file"
    )
    parser.add_argument("--gbs", type=int, required=True, help="global batch size in samples")
    add_config_flags(parser)
    parser.add_argument("--top", type=int, default=10, help="how many strategies to show (default 10)")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    add_search_flags(parser)
    parser.add_argument("--seed", type=seed_value, default=0, help="seed of the Bayesian search (default 0)")
    parser.add_argument(
        "--zero-stages", default="0,1,2,3", help="comma-separated ZeRO stages to consider (default 0,1,2,3)"
    )
    parser.add_argument(
        "--allow-cross-node-tp", action="store_true", help="let tensor parallelism span nodes"
    )
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default="native",
        help="the backend whose profile predicts the steps: native (default) or megatron-deepspeed",
    )
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    # Imported here so that `cona --help` does not load the planner (and BoTorch's torch).
    from cona.planner.search_choice import search_strategies
    from cona.planner.space import SpaceOptions
    from cona.planner.systems import load_system

    for flag_name, value in (("--top", args.top), ("--gpus", args.gpus), ("--gbs", args.gbs)):
        if value < 1:
            raise UsageError(f"{flag_name} must be at least 1, got {value}")
    config = load_config(args.config, overrides=args.overrides)
    system = load_system(args.system)
    options = SpaceOptions(
        zero_stages=_zero_stages(args.zero_stages), allow_cross_node_tp=args.allow_cross_node_tp
    )
    started = time.perf_counter()
    result = search_strategies(
        config.model,
        system,
        args.gpus,
        args.gbs,
        options=options,
        dtype=config.training.runtime.dtype,
        top_k=max(args.top, EXPLAIN_POOL),
        backend=run_profile(args.backend, config.training),
        botorch=botorch_choice(args),
        seed=args.seed,
    )
    seconds = time.perf_counter() - started
    header = {
        "model": config.model.name,
        "config": str(config.path),
        "system": system.name,
        "backend": args.backend,
        "gpus": args.gpus,
        "gbs": args.gbs,
        "method": result.method,
        "space_size": result.space_size,
        "evaluations": result.evaluations,
        "search_seconds": round(seconds, 4),
    }
    if args.json:
        print(json.dumps({**header, "candidates": candidate_rows(result)[: args.top]}, indent=2))
    else:
        _print_table(header, candidate_rows(result), args.top, system.gpu.memory_gib)
    return 0


def _zero_stages(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise UsageError(
            f"--zero-stages: expected comma-separated integers like 0,1,2,3, got {text!r}"
        ) from None


def candidate_rows(result: SearchResult) -> list[dict]:
    """One flat dict per ranked strategy: its fields, micro-batches, and every predicted quantity."""
    prediction = result.prediction
    arrays = {
        f.name: getattr(prediction, f.name)
        for f in dataclasses.fields(prediction)
        if isinstance(getattr(prediction, f.name), np.ndarray)
    }
    rows = []
    for rank in range(len(result.candidates)):
        strategy = result.candidates[rank]
        row = {"rank": rank + 1, **_strategy_dict(strategy), "micro_batches": strategy.micro_batches}
        for name, values in arrays.items():
            value = values[rank].item()
            row[name] = value
        row["memory_per_gpu_gib"] = row.get("memory_gib")
        rows.append(row)
    return rows


def _strategy_dict(strategy: Strategy) -> dict:
    return {f.name: getattr(strategy, f.name) for f in dataclasses.fields(strategy)}


def _print_table(header: dict, rows: list[dict], shown: int, capacity_gib: float) -> None:
    from rich.console import Console
    from rich.table import Table

    title = (
        f"{header['model']} on {header['gpus']} x {header['system']}, gbs {header['gbs']}: "
        f"{header['method']} search, {header['evaluations']} of {header['space_size']} strategies "
        f"evaluated in {header['search_seconds']:.2f} s; times in seconds per iteration; memory in GiB "
        f"per GPU of the {capacity_gib:g} GiB each has"
    )
    table = Table(title=title, title_justify="left")
    headings = ("#", "dp/tp/pp", "mbs x m", "ZeRO", "recompute", "SP", "v", "iter s")
    for name in (*headings, *(label for _, label in TIME_TERMS), "GiB per GPU", "tokens/s"):
        table.add_column(name, justify="left" if name in ("dp/tp/pp", "recompute") else "right", no_wrap=True)
    for row in rows[:shown]:
        table.add_row(
            str(row["rank"]),
            f"{row['dp']}/{row['tp']}/{row['pp']}",
            f"{row['mbs']} x {row['micro_batches']}",
            str(row["zero_stage"]),
            row["recompute"],
            "y" if row["sequence_parallel"] else "-",
            str(row["virtual_stages"]),
            f"{row['iteration_time_s']:.4g}",
            *(f"{row[key]:.3g}" for key, _ in TIME_TERMS),
            f"{row['memory_gib']:.1f}",
            f"{row['tokens_per_s']:.4g}",
        )
    console = Console()
    if not console.is_terminal:  # piped or captured: rich would squeeze the table into 80 columns
        console = Console(width=200)
    console.print(table)
    console.print(why_first_wins(rows))


def why_first_wins(rows: list[dict]) -> str:
    """How many strategies tie with the fastest (ranked first), and which time term makes it beat the best
    other layout."""
    first = rows[0]
    ties = sum(row["iteration_time_s"] <= first["iteration_time_s"] * (1 + TIE) for row in rows[1:])
    tied = f"{ties} more within {100 * TIE:g}% of #1 (options that cost no time here); " if ties else ""

    def layout(row: dict) -> tuple:
        return row["dp"], row["tp"], row["pp"], row["mbs"]

    other = next((row for row in rows if layout(row) != layout(first)), None)
    if other is None:
        return f"{tied}every fitting strategy found has #1's layout."
    gap = other["iteration_time_s"] - first["iteration_time_s"]
    term, label = max(TIME_TERMS, key=lambda item: other[item[0]] - first[item[0]])
    return (
        f"{tied}#1 is {100 * gap / other['iteration_time_s']:.1f}% faster than the best other layout "
        f"(#{other['rank']}, dp/tp/pp {other['dp']}/{other['tp']}/{other['pp']} mbs {other['mbs']}); the "
        f"largest difference is {label} ({first[term]:.3g} s vs {other[term]:.3g} s)."
    )
