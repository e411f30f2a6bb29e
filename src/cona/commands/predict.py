from cona.commands import not_yet


def register(subparsers) -> None:
    not_yet(subparsers, "predict", "Predict one strategy's iteration time and memory", 5)
