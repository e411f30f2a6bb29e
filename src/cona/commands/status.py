from cona.commands import not_yet


def register(subparsers) -> None:
    not_yet(subparsers, "status", "Where a run is", 8)
