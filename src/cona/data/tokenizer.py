"""The preprocessor's tokenizers (Megatron's ``--tokenizer-type`` names).

``GPT2BPETokenizer``: GPT-2 byte-level BPE from a ``vocab.json`` + ``merges.txt`` pair, run by tiktoken.
tiktoken's ``data_gym_to_mergeable_bpe_ranks`` turns OpenAI's original file pair into ranks and checks
that the two files agree; with GPT-2's split pattern this is exactly OpenAI's ``gpt2`` encoding. Text
is encoded with ``encode_ordinary``: a literal ``<|endoftext|>`` inside a document is ordinary text,
as in Megatron's GPT2BPETokenizer; the end-of-document id is only ever appended by the preprocessor.

``BertWordPieceLowerCase``: BERT's uncased WordPiece from a ``vocab.txt`` (one token per line, id = line
number), run by HF ``tokenizers`` (lower-casing, accent stripping, BERT's pre-tokenizer). Its [CLS], [SEP],
[MASK], [PAD] and [UNK] ids come from the file. Megatron's BERT tokenizer has no end-of-document token;
``--append-eod`` appends [SEP], which then separates documents inside the packed masked-LM samples.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import tiktoken
import tiktoken.load
import tokenizers
from tiktoken_ext.openai_public import r50k_pat_str as GPT2_PATTERN

from cona.errors import DataError, not_found

END_OF_TEXT = "<|endoftext|>"
GPT2_BPE = "GPT2BPETokenizer"
BERT_WORDPIECE_LOWER = "BertWordPieceLowerCase"
TOKENIZER_TYPES = (GPT2_BPE, BERT_WORDPIECE_LOWER)
WORDPIECE_SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
"""In the order a trained vocabulary gets them (ids 0..4); a downloaded BERT vocab.txt has its own ids."""


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
            raise DataError(f"{path}: {what} {not_found(path)}")


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


@dataclass(frozen=True, kw_only=True)
class WordPieceTokenizer:
    """BERT's lower-case WordPiece; ``encode`` adds no [CLS]/[SEP] (masked-LM samples add them)."""

    tokenizer: tokenizers.BertWordPieceTokenizer
    vocab_size: int
    """Lines of vocab.txt (30522 for BERT's uncased vocabulary)."""
    pad_id: int
    unk_id: int
    cls_id: int
    sep_id: int
    mask_id: int

    @property
    def eod_id(self) -> int:
        """What ``--append-eod`` appends: [SEP] (see the module docstring)."""
        return self.sep_id

    @property
    def special_ids(self) -> tuple[int, ...]:
        return (self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def load_wordpiece_tokenizer(vocab_file: str | Path) -> WordPieceTokenizer:
    """BERT's uncased WordPiece over ``vocab_file``; a missing file or special token raises DataError."""
    path = Path(vocab_file)
    if not path.is_file():
        raise DataError(f"{path}: vocab file {not_found(path)}")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise DataError(f"{path}: not a WordPiece vocab.txt (not UTF-8 text)") from None
    # A repeated line: the last one wins, as in tokenizers' WordPiece.read_file.
    ids = {token: index for index, token in enumerate(lines)}
    missing = [token for token in WORDPIECE_SPECIAL_TOKENS if token not in ids]
    if missing:
        raise DataError(
            f"{path}: not a BERT WordPiece vocab.txt: no {', '.join(missing)} line "
            f"(cona data bert-vocab makes one with {', '.join(WORDPIECE_SPECIAL_TOKENS)})"
        )
    wordpiece = tokenizers.BertWordPieceTokenizer(str(path), lowercase=True)
    return WordPieceTokenizer(
        tokenizer=wordpiece,
        vocab_size=len(lines),
        pad_id=ids["[PAD]"],
        unk_id=ids["[UNK]"],
        cls_id=ids["[CLS]"],
        sep_id=ids["[SEP]"],
        mask_id=ids["[MASK]"],
    )


Tokenizer = GPT2Tokenizer | WordPieceTokenizer


def tokenizer_files(tokenizer_type: str, vocab_file: Path, merge_file: Path | None) -> tuple[Path, ...]:
    """The files ``tokenizer_type`` reads; DataError naming the flag when one is not given."""
    if tokenizer_type == GPT2_BPE:
        if merge_file is None:
            raise DataError(f"--merge-file is required with --tokenizer-type {GPT2_BPE}")
        return (vocab_file, merge_file)
    if tokenizer_type == BERT_WORDPIECE_LOWER:
        return (vocab_file,)
    raise DataError(f"--tokenizer-type: {tokenizer_type!r} is not one of {', '.join(TOKENIZER_TYPES)}")


def files_fingerprint(files: tuple[Path, ...]) -> str:
    """Content hash of a tokenizer's files (see :func:`tokenizer_fingerprint`)."""
    for path in files:
        if not path.is_file():
            raise DataError(f"{path}: tokenizer file does not exist")
    return hashlib.sha256("".join(_sha256(path) for path in files).encode()).hexdigest()


@functools.lru_cache(maxsize=4)
def cached_tokenizer(tokenizer_type: str, files: tuple[str, ...], fingerprint: str) -> Tokenizer:
    """One tokenizer per process, type and file content (``files`` from :func:`tokenizer_files`)."""
    if tokenizer_type == BERT_WORDPIECE_LOWER:
        return load_wordpiece_tokenizer(*files)
    return cached_gpt2_tokenizer(*files, fingerprint)
