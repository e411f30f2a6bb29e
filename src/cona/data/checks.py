"""Checks of the dataset against the config that the runner makes before it starts any worker.

A stage evaluates on the validation split and embeds every token id, so a validation split without one
sample (``training.split`` "100,0,0", or ``model.seq`` longer than the split) or a token id the embedding
does not have (data tokenised with another vocabulary) would fail inside the workers, after start-up, as an
internal exception. :func:`check_dataset` refuses both with one line naming the key and the file. It reads
only the index and one pass over the token file (memory-mapped, in chunks).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cona.config import ConaConfig
from cona.data.indexed import IndexedDataset
from cona.data.masking import SPECIALS_PER_SAMPLE
from cona.data.split_ranges import split_document_ranges
from cona.errors import DataError

CHUNK_TOKENS = 1 << 24
"""Tokens read at a time by the id scan (32 MiB of uint16)."""


def check_dataset(config: ConaConfig) -> None:
    """Refuse a validation split with no sample and token ids >= ``model.vocab_size``."""
    training = config.training
    if training.data.data_prefix is None:
        return  # check_training_files names the missing key
    indexed = IndexedDataset(training.data.data_prefix)
    where = f"{config.path}: " if config.path else ""
    check_validation_split(config, indexed, where)
    if config.model.vocab_size is not None:
        check_token_ids(indexed, config.model.vocab_size, where, training.data.vocab_file)


def split_samples(config: ConaConfig, indexed: IndexedDataset) -> dict[str, tuple[int, int, int]]:
    """(documents, tokens, samples per epoch) of each split, as :mod:`cona.data.gpt_dataset` cuts them."""
    model = config.model
    length = model.seq - SPECIALS_PER_SAMPLE if model.family == "bert" else model.seq
    ranges = split_document_ranges(len(indexed), config.training.data.split)
    sizes = indexed.sizes.astype(np.int64)
    result = {}
    for name, (begin, end) in zip(("train", "valid", "test"), ranges, strict=True):
        tokens = int(sizes[begin:end].sum())
        result[name] = (end - begin, tokens, max(tokens - 1, 0) // max(length, 1))
    return result


def check_validation_split(config: ConaConfig, indexed: IndexedDataset, where: str) -> None:
    documents, tokens, samples = split_samples(config, indexed)["valid"]
    if samples > 0:
        return
    data = config.training.data
    raise DataError(
        f"{where}training.split {data.split!r} with model.seq {config.model.seq} leaves the validation "
        f"split no sample ({documents} documents, {tokens} tokens of {data.data_prefix}); evaluation "
        "needs one: give the second weight more, or lower model.seq"
    )


def check_token_ids(indexed: IndexedDataset, vocab_size: int, where: str, vocab_file: str | None) -> None:
    """Refuse a token id outside ``[0, vocab_size)`` anywhere in the ``.bin`` file."""
    dtype = indexed.dtype
    if np.issubdtype(dtype, np.unsignedinteger) and np.iinfo(dtype).max < vocab_size:
        return  # no stored value can reach vocab_size
    tokens = _token_array(indexed.bin_path, dtype)
    for start in range(0, len(tokens), CHUNK_TOKENS):
        chunk = tokens[start : start + CHUNK_TOKENS]
        low, high = int(chunk.min()), int(chunk.max())
        if high >= vocab_size or low < 0:
            bad = high if high >= vocab_size else low
            source = f" (training.vocab_file: {vocab_file})" if vocab_file else ""
            raise DataError(
                f"{where}model.vocab_size: {indexed.bin_path} holds token id {bad}, but model.vocab_size is "
                f"{vocab_size}{source}; was the data tokenised with another vocabulary?"
            )


def _token_array(path: Path, dtype: np.dtype) -> np.ndarray:
    if path.stat().st_size == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")
