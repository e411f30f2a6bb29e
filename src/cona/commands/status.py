"""``cona status [RUN_DIR]``: where a run is (stage, iteration, checkpoint, last decision, processes)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from cona.commands.config_flags import add_config_flags


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "status",
        help="Where a run is",
        description="One screen on a run: its stage, iteration, tokens, last loss and eval perplexity, last "
        "checkpoint and its markers, last decision, and whether its workers are alive on this host.",
    )
    parser.add_argument(
        "run_dir",
        nargs="?",
        type=Path,
        default=None,
        metavar="RUN_DIR",
        help="run directory (default: the 'latest' run under training.log_root of the config)",
    )
    add_config_flags(parser, "config file naming log_root (default: .conaconfig in cwd or a parent)")
    parser.set_defaults(func=run_status)


def run_status(args: argparse.Namespace) -> int:
    from rich.console import Console

    from cona.runner.views.status import collect_status, render_status

    run_dir = args.run_dir if args.run_dir is not None else latest_run_dir(args.config, args.overrides)
    render_status(collect_status(run_dir), Console(highlight=False))
    return 0


def latest_run_dir(config_path: str | None, overrides: Sequence[str] = ()) -> Path:
    """The run ``<log_root>/latest`` names, with log_root from the config (relative to its file)."""
    from cona.config.file import load_config
    from cona.runner.run_dir import resolve_latest, resolve_log_root

    config = resolve_log_root(load_config(config_path, overrides=overrides))
    return resolve_latest(Path(config.training.logging.log_root))
