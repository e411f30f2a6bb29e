"""``cona report RUN_DIR [RUN_DIR ...] [--out DIR]``: PNG figures and one HTML page from run directories."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "report",
        help="Plots and an HTML page from run directories",
        description="Draw loss, eval perplexity, global batch and layout, noise scale, throughput and switch "
        "costs of one or more runs (finished or still running; several are overlaid, one colour "
        "each) into PNG files and one self-contained index.html, with the stage, switch-cost and "
        "decision tables. Unreadable metrics lines are skipped with a warning naming the line.",
    )
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="run directories")
    parser.add_argument(
        "--out", type=Path, default=None, metavar="DIR", help="output directory (default: RUN_DIR/report)"
    )
    parser.set_defaults(func=run_report)


def run_report(args: argparse.Namespace) -> int:
    from cona.runner.views.report_build import build_report  # matplotlib loads only for this command

    result = build_report(args.run_dirs, args.out)
    print(f"report: {result.html}")
    for figure in result.figures:
        print(f"  {figure.name}")
    if result.warnings:
        print(f"{len(result.warnings)} warning(s): the report shows what could be read")
    return 0
