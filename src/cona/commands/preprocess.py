from cona.commands import not_yet


def register(subparsers) -> None:
    not_yet(subparsers, "preprocess", "Tokenize a jsonl file into a Megatron indexed dataset", 2)
