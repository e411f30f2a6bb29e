from cona.commands import not_yet


def register(subparsers) -> None:
    not_yet(subparsers, "data", "Inspect indexed datasets and obtain the demo data", 2)
