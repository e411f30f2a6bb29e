"""``cona config show``: the resolved .conaconfig, defaults and derived values included."""

from __future__ import annotations

import argparse
import json

from cona.config_file import load_config


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "config", help="Show the resolved .conaconfig", description="Show the resolved .conaconfig."
    )
    actions = parser.add_subparsers(dest="config_action", metavar="ACTION", required=True)
    show = actions.add_parser(
        "show", help="Print the resolved config as JSON (defaults and derived values filled)"
    )
    show.add_argument("--config", default=None, help="config file (default: .conaconfig in cwd or a parent)")
    show.set_defaults(func=_show)


def _show(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    resolved = config.to_dict()
    resolved["model"]["ffn_hidden"] = config.model.ffn_size
    if config.model.vocab_size is not None:
        resolved["model"]["padded_vocab_size"] = config.model.padded_vocab_size
    print(f"# {config.path}")
    print(json.dumps(resolved, indent=2))
    return 0
