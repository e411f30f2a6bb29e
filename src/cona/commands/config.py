"""``cona config show``: the resolved .conaconfig, defaults and derived values included."""

from __future__ import annotations

import argparse
import json
import sys

from cona.commands.config_flags import add_config_flags
from cona.config.file import load_config


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "config", help="Show the resolved .conaconfig", description="Show the resolved .conaconfig."
    )
    actions = parser.add_subparsers(dest="config_action", metavar="ACTION", required=True)
    show = actions.add_parser(
        "show",
        help="Print the resolved config as JSON (defaults and derived values filled)",
        description="Print the resolved config as JSON on stdout (defaults and derived values filled); "
        "the file it came from is named on stderr.",
    )
    add_config_flags(show)
    show.set_defaults(func=_show)


def _show(args: argparse.Namespace) -> int:
    config = load_config(args.config, overrides=args.overrides)
    resolved = config.to_dict()
    resolved["model"]["ffn_hidden"] = config.model.ffn_size
    if config.model.vocab_size is not None:
        resolved["model"]["padded_vocab_size"] = config.model.padded_vocab_size
    # stdout is the JSON alone (cona config show > resolved.json, or piped to jq); the file it came from
    # goes to stderr.
    print(f"# {config.path}", file=sys.stderr)
    print(json.dumps(resolved, indent=2))
    return 0
