"""``--config FILE`` and ``--set SECTION.KEY=VALUE``, the same on every command that loads a config."""

from __future__ import annotations

import argparse

from cona.config.overrides import FLAG

CONFIG_HELP = "config file (default: .conaconfig in cwd or a parent)"


def add_config_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, config_help: str = CONFIG_HELP
) -> None:
    parser.add_argument("--config", default=None, help=config_help)
    parser.add_argument(
        FLAG,
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a config key, e.g. --set training.base_lr=3e-4 (repeatable; the value is read as JSON "
        "when it parses, else as a string; a relative path is relative to the current directory)",
    )
