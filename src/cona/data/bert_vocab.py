"""``cona data bert-vocab``: train a BERT lower-case WordPiece ``vocab.txt`` from a jsonl corpus.

No BERT vocabulary is downloaded anywhere in the project; the demo and the tests train their own with
HF ``tokenizers``' WordPiece trainer (BERT's normaliser and pre-tokenizer, ``##`` continuation prefix). The
special tokens get ids 0..4 in the order of :data:`~cona.data.tokenizer.WORDPIECE_SPECIAL_TOKENS`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import tokenizers

from cona.atomic_files import write_atomic
from cona.data.tokenizer import WORDPIECE_SPECIAL_TOKENS
from cona.errors import DataError, not_found

VOCAB_NAME = "vocab.txt"
MIN_VOCAB_SIZE = len(WORDPIECE_SPECIAL_TOKENS) + 1


@dataclass(frozen=True, kw_only=True)
class BertVocab:
    path: Path
    vocab_size: int
    documents: int


def jsonl_texts(path: Path, key: str) -> Iterator[str]:
    """The string under ``key`` of every non-blank line; a bad line raises DataError naming file and line."""
    with open(path, "rb") as source:  # bytes: a line that is not UTF-8 is named as such, as preprocess does
        for line_no, line in enumerate(source, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}, line {line_no}: not valid JSON ({err.msg})") from None
            except UnicodeDecodeError:
                raise DataError(f"{path}, line {line_no}: not valid UTF-8") from None
            if not isinstance(record, dict) or not isinstance(record.get(key), str):
                raise DataError(f"{path}, line {line_no}: no string under key {key!r} (--json-key)")
            yield record[key]


class CountedTexts:
    """The ``key`` texts of a jsonl corpus as a trainer consumes them, counting the documents on the way
    (a trainer that reads from an iterator says nothing of how many it read)."""

    def __init__(self, path: Path, key: str) -> None:
        self.path, self.key = path, key
        self.documents = 0

    def __iter__(self) -> Iterator[str]:
        for text in jsonl_texts(self.path, self.key):
            self.documents += 1
            yield text


def train_bert_vocab(corpus: Path, out_dir: Path, *, vocab_size: int, json_key: str = "text") -> BertVocab:
    """Train a WordPiece vocabulary of at most ``vocab_size`` entries on ``corpus``; write
    ``out_dir/vocab.txt``."""
    if not corpus.is_file():
        raise DataError(f"--corpus: {corpus} {not_found(corpus)}")
    if vocab_size < MIN_VOCAB_SIZE:
        raise DataError(f"--vocab-size: must be at least {MIN_VOCAB_SIZE}, got {vocab_size}")
    texts = CountedTexts(corpus, json_key)
    wordpiece = tokenizers.BertWordPieceTokenizer(lowercase=True)
    wordpiece.train_from_iterator(
        iter(texts),
        vocab_size=vocab_size,
        special_tokens=list(WORDPIECE_SPECIAL_TOKENS),
        show_progress=False,
    )
    if texts.documents == 0:
        raise DataError(f"--corpus: {corpus} holds no documents")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / VOCAB_NAME
    vocab = wordpiece.get_vocab()
    lines = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    write_atomic(path, "".join(f"{token}\n" for token in lines))  # a reader never sees half a vocabulary
    return BertVocab(path=path, vocab_size=len(vocab), documents=texts.documents)
