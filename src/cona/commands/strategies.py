from cona.commands import not_yet


def register(subparsers) -> None:
    not_yet(subparsers, "strategies", "Rank the valid parallel strategies for a GPU count and global batch", 5)
