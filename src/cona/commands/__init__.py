"""Subcommands of ``cona``: each module has ``register(subparsers)`` and keeps its logic elsewhere."""
