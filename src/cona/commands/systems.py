"""``cona systems [--json]``: the system descriptions shipped with CONA, the names ``--system`` takes."""

from __future__ import annotations

import argparse
import json
from typing import Any

from cona.planner.systems import System, available_systems, load_system

COLUMNS = ("name", "gpus_per_node", "peak_tflops", "memory_gib", "memory_gbps", "intra_gbps", "inter_gbps")
HEADERS = ("name", "GPUs/node", "peak TFLOP/s", "memory GiB", "memory GB/s", "intra GB/s", "inter GB/s")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "systems",
        help="List the system descriptions (--system names)",
        description="List the hardware descriptions shipped with CONA, the names cona train / predict / "
        "strategies / plan take as --system (a path to a JSON file of the same form works too): GPUs per "
        "node, the GPU's dense peak per dtype, its memory and bandwidth, the links inside and between "
        "nodes (GB/s per direction), and what the system is.",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object per system, a line each")
    parser.set_defaults(func=run_systems)


def system_row(system: System) -> dict[str, Any]:
    """What ``cona systems`` shows of one system."""
    return {
        "name": system.name,
        "gpus_per_node": system.gpus_per_node,
        "peak_tflops": dict(system.gpu.matrix_tflops),
        "memory_gib": system.gpu.memory_gib,
        "memory_gbps": system.gpu.memory_gbps,
        "intra_gbps": system.intra_node.bandwidth_gbps,
        "inter_gbps": system.inter_node.bandwidth_gbps,
        "gpu": _first_sentence(system.comment),
    }


def run_systems(args: argparse.Namespace) -> int:
    rows = [system_row(load_system(name)) for name in available_systems()]
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    cells = [HEADERS, *([_cell(row[key]) for key in COLUMNS] for row in rows)]
    widths = [max(len(line[column]) for line in cells) for column in range(len(COLUMNS))]
    for line, row in zip(cells, [None, *rows], strict=True):
        text = "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True))
        print(f"{text}  {row['gpu'] if row else 'what it is'}")
    return 0


def _cell(value: Any) -> str:
    if isinstance(value, dict):  # the peak per dtype: "bf16 312, fp32 156"
        return ", ".join(f"{dtype} {rate:g}" for dtype, rate in value.items())
    return f"{value:g}" if isinstance(value, float) else str(value)


def _first_sentence(comment: str) -> str:
    """The system files open their comment with what the system is ("DGX A100 80GB: 8 GPUs per node ...")."""
    return comment.split(". ")[0].rstrip(".")
