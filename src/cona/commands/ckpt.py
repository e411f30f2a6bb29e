from cona.commands import not_yet


def register(subparsers) -> None:
    not_yet(subparsers, "ckpt", "Inspect and export checkpoints", 4)
