"""A small GPT-2-format byte-level BPE vocabulary trained on a jsonl corpus (the tiny example's tokenizer).

GPT-2's 50,257 entries make the embedding and output head of a tiny model cost far more than its blocks
(hidden 64: 64 x 50257 multiply-adds per token in the head alone). The demo set-up therefore trains a
4096-entry vocabulary on the demo text with HF ``tokenizers`` (BPE model, GPT-2's ByteLevel
pre-tokenizer and 256-character alphabet, no special tokens) and writes it as the same
``vocab.json`` + ``merges.txt`` pair GPT-2 ships, which :func:`cona.data.tokenizer.load_gpt2_tokenizer`
(tiktoken's ``data_gym_to_mergeable_bpe_ranks``) reads:

- ids 0..255 are the single bytes in data_gym's order: the printable non-space bytes, then the others,
  written as ``chr(256 + n)``; HF's ByteLevel uses the same byte -> character map, so its merge strings
  are already in that encoding;
- then one id per merge, in merge order (tiktoken merges the pair whose result has the lowest id, so ids
  must follow merge priority; HF's own token ids are not used);
- ``<|endoftext|>`` last.

The trainer is deterministic (ties are broken by pair, not by hash order), so the same corpus gives
byte-identical files.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from cona.atomic_files import write_atomic
from cona.data.bert_vocab import CountedTexts
from cona.data.tokenizer import END_OF_TEXT
from cona.errors import DataError

BYTE_TOKENS = 256
MIN_VOCAB_SIZE = BYTE_TOKENS + 1  # the bytes and <|endoftext|>
MERGES_HEADER = "#version: 0.2\n"


@dataclass(frozen=True, kw_only=True)
class SmallBpe:
    vocab_file: Path
    merge_file: Path
    vocab_size: int
    """Entries of vocab.json, ``<|endoftext|>`` included (at most the requested size: a small corpus can
    run out of pairs to merge)."""
    documents: int


def data_gym_byte_tokens() -> list[str]:
    """The 256 single-byte tokens as vocab.json spells them, in rank order 0..255 (tiktoken's data_gym)."""
    printable = [b for b in range(BYTE_TOKENS) if chr(b).isprintable() and chr(b) != " "]
    others = BYTE_TOKENS - len(printable)
    return [chr(b) for b in printable] + [chr(BYTE_TOKENS + n) for n in range(others)]


def gpt2_vocab_and_merges(merges: Sequence[tuple[str, str]]) -> tuple[dict[str, int], str]:
    """vocab.json's mapping and merges.txt's text for ``merges`` (in priority order).

    A merge whose result is already a token is left out: tiktoken ranks tokens, not pairs, so it adds
    nothing, and keeping it would give that token two ranks and make the pair fail tiktoken's check.
    """
    vocab = {token: rank for rank, token in enumerate(data_gym_byte_tokens())}
    kept: list[tuple[str, str]] = []
    for first, second in merges:
        if first not in vocab or second not in vocab:
            raise DataError(f"BPE merge {first!r} + {second!r} uses a token no earlier merge made")
        if first + second not in vocab:
            vocab[first + second] = len(vocab)
            kept.append((first, second))
    vocab[END_OF_TEXT] = len(vocab)
    return vocab, MERGES_HEADER + "".join(f"{first} {second}\n" for first, second in kept)


def train_byte_level_merges(texts: Iterator[str], *, vocab_size: int) -> list[tuple[str, str]]:
    """HF ``tokenizers``' BPE merges over ``texts``, at most ``vocab_size - 1`` tokens with the 256 bytes
    (the last entry is left for ``<|endoftext|>``)."""
    tokenizer = Tokenizer(models.BPE())
    # GPT-2 adds no space before the first word; the regex split matches tiktoken's GPT-2 pattern.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    # tokenizers >= 0.20 serialises a merge as [first, second], older versions as "first second".
    return [tuple(merge.split(" ")) if isinstance(merge, str) else tuple(merge) for merge in merges]


def train_small_bpe(
    corpus: Path, vocab_file: Path, merge_file: Path, *, vocab_size: int, json_key: str = "text"
) -> SmallBpe:
    """Train on the ``json_key`` texts of the jsonl ``corpus``; write ``vocab_file`` and ``merge_file``."""
    if not corpus.is_file():
        raise DataError(f"{corpus}: corpus file does not exist (needed to train {vocab_file.name})")
    if vocab_size < MIN_VOCAB_SIZE:
        raise DataError(f"{vocab_file.name}: vocab size must be at least {MIN_VOCAB_SIZE}, got {vocab_size}")
    texts = CountedTexts(corpus, json_key)
    merges = train_byte_level_merges(iter(texts), vocab_size=vocab_size)
    if texts.documents == 0:
        raise DataError(f"{corpus}: holds no documents to train {vocab_file.name} on")
    vocab, merges_text = gpt2_vocab_and_merges(merges)
    # ASCII JSON (GPT-2's own encoder.json is too): readable whatever the locale's default encoding.
    write_atomic(vocab_file, json.dumps(vocab) + "\n")
    write_atomic(merge_file, merges_text)
    return SmallBpe(
        vocab_file=vocab_file, merge_file=merge_file, vocab_size=len(vocab), documents=texts.documents
    )
