from cona.commands import not_yet


def register(subparsers) -> None:
    not_yet(subparsers, "report", "Plots and an HTML page from run directories", 8)
