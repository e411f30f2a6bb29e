"""GPT-2 byte-level BPE from a ``vocab.json`` + ``merges.txt`` pair, run by tiktoken.

tiktoken's ``data_gym_to_mergeable_bpe_ranks`` turns OpenAI's original file pair into ranks and checks
that the two files agree; with GPT-2's split pattern this is exactly OpenAI's ``gpt2`` encoding. Text
is encoded with ``encode_ordinary``: a literal ``<|endoftext|>`` inside a document is ordinary text,
as in Megatron's GPT2BPETokenizer; the end-of-document id is only ever appended by the preprocessor.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import tiktoken
import tiktoken.load
from tiktoken_ext.openai_public import r50k_pat_str as GPT2_PATTERN

from cona.errors import DataError

END_OF_TEXT = "<|endoftext|>"


@dataclass(frozen=True, kw_only=True)
class GPT2Tokenizer:
    encoding: tiktoken.Encoding
    eod_id: int
    """Id of ``<|endoftext|>`` (50256 for GPT-2)."""
    vocab_size: int
    """Entries of vocab.json, the special token included (50257 for GPT-2)."""

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(text)

    def decode(self, ids: list[int]) -> str:
        return self.encoding.decode(ids)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _check_exist(vocab_file: Path, merge_file: Path) -> None:
    for what, path in (("vocab file", vocab_file), ("merge file", merge_file)):
        if not path.is_file():
            raise DataError(f"{path}: {what} does not exist")


def load_gpt2_tokenizer(vocab_file: str | Path, merge_file: str | Path) -> GPT2Tokenizer:
    """Build the tokenizer; a missing file, or files that do not belong together, raise DataError."""
    vocab_path, merge_path = Path(vocab_file), Path(merge_file)
    _check_exist(vocab_path, merge_path)
    try:
        vocab = json.loads(vocab_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DataError(f"{vocab_path}: not a GPT-2 vocab.json: {err}") from None
    if not isinstance(vocab, dict) or END_OF_TEXT not in vocab:
        raise DataError(f"{vocab_path}: not a GPT-2 vocab.json (no {END_OF_TEXT!r} entry)")
    try:
        # tiktoken caches file contents by path in a temp dir; passing the current content hashes makes
        # it re-read a file that changed since (a stale cache would silently give other ranks).
        ranks = tiktoken.load.data_gym_to_mergeable_bpe_ranks(
            vocab_bpe_file=str(merge_path),
            encoder_json_file=str(vocab_path),
            vocab_bpe_hash=_sha256(merge_path),
            encoder_json_hash=_sha256(vocab_path),
        )
    except (AssertionError, KeyError, ValueError, UnicodeDecodeError):
        raise DataError(
            f"{vocab_path} and {merge_path} are not a matching GPT-2 vocab.json/merges.txt pair"
        ) from None
    eod_id = int(vocab[END_OF_TEXT])
    encoding = tiktoken.Encoding(
        name=f"gpt2-bpe-{vocab_path.name}",
        pat_str=GPT2_PATTERN,
        mergeable_ranks=ranks,
        special_tokens={END_OF_TEXT: eod_id},
    )
    return GPT2Tokenizer(encoding=encoding, eod_id=eod_id, vocab_size=len(vocab))


def tokenizer_fingerprint(vocab_file: str | Path, merge_file: str | Path) -> str:
    """Content hash of a file pair: the key under which processes share a tokenizer."""
    _check_exist(Path(vocab_file), Path(merge_file))
    return hashlib.sha256((_sha256(Path(vocab_file)) + _sha256(Path(merge_file))).encode()).hexdigest()


@functools.lru_cache(maxsize=4)
def cached_gpt2_tokenizer(vocab_file: str, merge_file: str, fingerprint: str) -> GPT2Tokenizer:
    """One tokenizer per process and file content (preprocessing workers build theirs on first use);
    ``fingerprint`` (:func:`tokenizer_fingerprint`) keeps a changed file from hitting a stale entry."""
    return load_gpt2_tokenizer(vocab_file, merge_file)
