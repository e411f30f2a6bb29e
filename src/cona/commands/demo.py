from cona.commands import not_yet


def register(subparsers) -> None:
    not_yet(subparsers, "demo", "Run the CPU demo (online strategy chaining on the tiny GPT)", 6)
