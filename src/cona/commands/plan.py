from cona.commands import not_yet


def register(subparsers) -> None:
    not_yet(subparsers, "plan", "Plan a strategy chain offline on a recorded trace", 6)
