"""``cona preprocess``: jsonl -> Megatron mmap indexed dataset (flags of Megatron's preprocess_data.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from cona.data.preprocess import PreprocessOptions, preprocess
from cona.data.tokenizer import GPT2_BPE, TOKENIZER_TYPES


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "preprocess",
        help="Tokenize a jsonl file into a Megatron indexed dataset",
        description="Tokenize a jsonl file (one JSON object per line) with GPT-2 BPE or BERT's lower-case "
        "WordPiece into "
        "<output-prefix>_<key>_document.{bin,idx} for each --json-keys key (Megatron mmap format).",
    )
    parser.add_argument("--input", required=True, type=Path, help="jsonl file, one JSON object per line")
    parser.add_argument(
        "--output-prefix", required=True, help="outputs are <prefix>_<key>_document.{bin,idx}"
    )
    parser.add_argument(
        "--vocab-file", required=True, type=Path, help="GPT-2 vocab.json, or WordPiece vocab.txt (BERT)"
    )
    parser.add_argument(
        "--merge-file", type=Path, default=None, help="GPT-2 merges.txt (GPT2BPETokenizer only)"
    )
    parser.add_argument("--tokenizer-type", default=GPT2_BPE, choices=list(TOKENIZER_TYPES))
    parser.add_argument("--dataset-impl", default="mmap", choices=["mmap"])
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="keys to tokenize (default: text)")
    parser.add_argument(
        "--append-eod",
        action="store_true",
        help="append <|endoftext|> (WordPiece: [SEP]) to every document",
    )
    parser.add_argument("--workers", type=int, default=1, help="encoding processes (default: 1)")
    parser.add_argument(
        "--skip-bad-lines",
        action="store_true",
        help="skip malformed lines (bad JSON, missing key) and print how many, instead of failing",
    )
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    options = PreprocessOptions(
        input=args.input,
        output_prefix=args.output_prefix,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        tokenizer_type=args.tokenizer_type,
        json_keys=tuple(args.json_keys),
        append_eod=args.append_eod,
        workers=args.workers,
        skip_bad_lines=args.skip_bad_lines,
    )
    result = preprocess(options)
    for key, prefix in result.outputs.items():
        print(f"wrote {prefix}.bin/.idx: {result.documents} documents, {result.tokens[key]} tokens ('{key}')")
    if result.skipped_lines:
        print(f"skipped {result.skipped_lines} malformed lines (--skip-bad-lines)")
    seconds = max(result.seconds, 1e-9)
    total_tokens = sum(result.tokens.values())
    print(
        f"{result.input_bytes / 1e6:.1f} MB in {result.seconds:.2f} s with {args.workers} worker(s): "
        f"{result.documents / seconds:.0f} documents/s, {total_tokens / seconds:.0f} tokens/s"
    )
    return 0
