from cona.commands import not_yet


def register(subparsers) -> None:
    not_yet(subparsers, "train", "Train under a fixed strategy, a chain, or online search", 3)
