"""Megatron's mmap indexed dataset: ``<prefix>.bin`` (token ids back to back) + ``<prefix>.idx``.

``.idx`` layout (little-endian), as Megatron-LM and Megatron-DeepSpeed read and write it::

    magic  b"MMIDIDX\\x00\\x00" (9 bytes) | version u64 = 1 | dtype code u8 | N u64 | D u64
    sizes int32[N] | pointers int64[N] (byte offset of each sequence in .bin) | doc_idx int64[D]

One document is one sequence here (no sentence splitting), so ``doc_idx`` is ``0..N``. The reader
accepts any valid ``doc_idx`` and the optional int8[N] "sequence modes" newer Megatron-core appends. Token ids
are integers: the float dtype codes Megatron's table holds (6, 7) are refused by reader and writer alike.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from types import TracebackType

import numpy as np

from cona.atomic_files import fsync_dir
from cona.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
LEGACY_MAGIC = b"TNTIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, N sequences, D = len(doc_idx)
DTYPE_CODES: dict[int, type[np.generic]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
# Megatron's rule: uint16 holds ids up to 65535, but it switches to int32 already at 65500.
UINT16_VOCAB_LIMIT = 65500


def token_dtype(vocab_size: int) -> np.dtype:
    """The dtype Megatron's writer picks for a vocabulary: uint16 below 65500 ids, else int32."""
    return np.dtype(np.uint16 if vocab_size < UINT16_VOCAB_LIMIT else np.int32)


def dtype_code(dtype: np.dtype | type[np.generic]) -> int:
    wanted = np.dtype(dtype)
    if wanted.kind == "f":
        raise DataError(f"dtype {wanted} cannot hold token ids (they are integers)")
    for code, candidate in DTYPE_CODES.items():
        if np.dtype(candidate) == wanted:
            return code
    raise DataError(f"dtype {wanted} cannot be stored in an indexed dataset")


def index_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.idx")


def data_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.bin")


def _map_file(path: Path) -> np.ndarray:
    """The whole file as a read-only uint8 memmap (numpy cannot map an empty file)."""
    if path.stat().st_size == 0:
        return np.zeros(0, dtype=np.uint8)
    return np.memmap(path, dtype=np.uint8, mode="r")


class IndexedDataset:
    """Read-only view of a ``.bin``/``.idx`` pair; token arrays are views of the memory-mapped ``.bin``."""

    def __init__(self, prefix: str | Path) -> None:
        self.prefix = str(prefix)
        self.idx_path = index_path(prefix)
        self.bin_path = data_path(prefix)
        for path in (self.idx_path, self.bin_path):
            if not path.is_file():
                raise DataError(f"{path}: indexed dataset file does not exist")
        self._read_index()
        self._bin = _map_file(self.bin_path)
        self._check_bin_length()

    def _read_index(self) -> None:
        path = self.idx_path
        buffer = _map_file(path)
        head = bytes(buffer[: HEADER.size])
        if head.startswith(LEGACY_MAGIC):
            raise DataError(
                f"{path}: legacy lazy/cached indexed format (TNTIDX); only mmap (MMIDIDX) is "
                "supported: re-run the preprocessing with --dataset-impl mmap"
            )
        if not head.startswith(MAGIC):
            raise DataError(f"{path}: not a Megatron mmap index (magic {head[:9]!r}, expected {MAGIC!r})")
        if len(head) < HEADER.size:
            raise DataError(
                f"{path}: truncated: {len(head)} bytes, shorter than the {HEADER.size}-byte header"
            )
        _, version, code, num_sequences, num_doc_idx = HEADER.unpack(head)
        if version != VERSION:
            raise DataError(f"{path}: index version {version} is not supported (expected {VERSION})")
        if code not in DTYPE_CODES:
            raise DataError(f"{path}: dtype code {code} is out of range (valid codes 1..{len(DTYPE_CODES)})")
        if np.dtype(DTYPE_CODES[code]).kind == "f":
            raise DataError(
                f"{path}: dtype code {code} is {np.dtype(DTYPE_CODES[code])}, a float type; token ids are "
                "integers (a float would be cut to an id, or be NaN): write the data with an integer dtype"
            )
        expected = HEADER.size + 12 * num_sequences + 8 * num_doc_idx
        if len(buffer) < expected:
            raise DataError(
                f"{path}: truncated: {len(buffer)} bytes, the header announces {num_sequences} "
                f"sequences and {num_doc_idx} doc_idx entries ({expected} bytes)"
            )
        if len(buffer) not in (expected, expected + num_sequences):
            raise DataError(
                f"{path}: {len(buffer)} bytes, expected {expected} (or {expected + num_sequences} "
                "with sequence modes)"
            )
        self.dtype = np.dtype(DTYPE_CODES[code]).newbyteorder("<")
        self.sizes = np.frombuffer(buffer, np.int32, num_sequences, HEADER.size)
        self.pointers = np.frombuffer(buffer, np.int64, num_sequences, HEADER.size + 4 * num_sequences)
        self.doc_idx = np.frombuffer(buffer, np.int64, num_doc_idx, HEADER.size + 12 * num_sequences)
        self._check_index_arrays()

    def _check_index_arrays(self) -> None:
        path, sizes, doc_idx = self.idx_path, self.sizes, self.doc_idx
        if len(sizes) and int(sizes.min()) < 0:
            raise DataError(f"{path}: negative sequence size at sequence {int(np.argmax(sizes < 0))}")
        expected = np.zeros(len(sizes), dtype=np.int64)
        np.cumsum(sizes[:-1].astype(np.int64) * self.dtype.itemsize, out=expected[1:])
        if not np.array_equal(self.pointers, expected):
            first = int(np.argmax(self.pointers != expected))
            raise DataError(
                f"{path}: pointer of sequence {first} is {int(self.pointers[first])}, but the sizes "
                f"before it put it at byte {int(expected[first])}"
            )
        if len(doc_idx) == 0 or doc_idx[0] != 0 or doc_idx[-1] != len(sizes) or np.any(np.diff(doc_idx) < 0):
            raise DataError(f"{path}: doc_idx must rise from 0 to the number of sequences ({len(sizes)})")

    def _check_bin_length(self) -> None:
        described = int(self.sizes.astype(np.int64).sum()) * self.dtype.itemsize
        actual = len(self._bin)
        if actual < described:
            raise DataError(
                f"{self.bin_path}: {actual} bytes, shorter than the {described} bytes "
                f"{self.idx_path.name} describes (truncated .bin?)"
            )
        if actual > described:
            # Megatron-DeepSpeed's --append-eod bug leaves the EOD out of each size: refuse rather than
            # read every later document shifted by one token per preceding document.
            raise DataError(
                f"{self.bin_path}: {actual} bytes, longer than the {described} bytes "
                f"{self.idx_path.name} describes (sizes that omit the EOD?)"
            )

    def __len__(self) -> int:
        """Number of sequences (= documents when every document is one sequence)."""
        return len(self.sizes)

    @property
    def num_documents(self) -> int:
        return len(self.doc_idx) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sizes.astype(np.int64).sum())

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``index`` (to its end when length is None)."""
        size = int(self.sizes[index])
        count = size - offset if length is None else min(length, size - offset)
        start = int(self.pointers[index]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, self.dtype, max(count, 0), start)

    def __getitem__(self, index: int) -> np.ndarray:
        return self.get(index)

    def document(self, doc: int) -> np.ndarray:
        """All tokens of document ``doc`` (its sequences concatenated)."""
        if not 0 <= doc < self.num_documents:
            raise DataError(f"{self.prefix}: document {doc} out of range (0..{self.num_documents - 1})")
        first, last = int(self.doc_idx[doc]), int(self.doc_idx[doc + 1])
        parts = [self.get(i) for i in range(first, last)]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=self.dtype)


class IndexedDatasetWriter:
    """Writes ``<prefix>.bin`` and ``<prefix>.idx``, one sequence per document.

    Both files are written under temporary names and renamed by :meth:`finalize`, so an interrupted or
    failed run never leaves a pair that looks complete. Use as a context manager.
    """

    def __init__(self, prefix: str | Path, dtype: np.dtype | type[np.generic]) -> None:
        self.dtype = np.dtype(dtype)
        self._code = dtype_code(self.dtype)
        self.idx_path = index_path(prefix)
        self.bin_path = data_path(prefix)
        for path in (self.bin_path, self.idx_path):  # found now, not after the .bin was replaced
            if path.is_dir():
                raise DataError(f"{path} is a directory; the dataset's output prefix must name files")
        self._tmp_suffix = f".tmp{os.getpid()}"
        self._bin_tmp = Path(f"{self.bin_path}{self._tmp_suffix}")
        self._bin_file = open(self._bin_tmp, "wb")  # noqa: SIM115 -- closed by finalize/abort
        self._sizes: list[np.ndarray] = []
        self.num_tokens = 0

    def add_document(self, tokens: np.ndarray | list[int]) -> None:
        array = np.asarray(tokens)
        self.add_documents(array, np.array([len(array)], dtype=np.int64))

    def add_documents(self, tokens: np.ndarray, sizes: np.ndarray) -> None:
        """Append several documents given as one flat token array and each document's length."""
        if int(np.sum(sizes)) != len(tokens):
            raise ValueError(f"sizes add up to {int(np.sum(sizes))}, but {len(tokens)} tokens were given")
        if self.dtype.kind in "iu" and len(tokens) and int(np.max(tokens)) > np.iinfo(self.dtype).max:
            raise ValueError(f"token id {int(np.max(tokens))} does not fit the dataset dtype {self.dtype}")
        self._bin_file.write(np.ascontiguousarray(tokens, dtype=self.dtype.newbyteorder("<")).tobytes())
        self._sizes.append(np.asarray(sizes, dtype=np.int32))
        self.num_tokens += len(tokens)

    @property
    def num_documents(self) -> int:
        return sum(len(s) for s in self._sizes)

    def finalize(self) -> None:
        self._bin_file.flush()
        os.fsync(self._bin_file.fileno())  # both files durable before their renames (cona.atomic_files)
        self._bin_file.close()
        sizes = np.concatenate(self._sizes) if self._sizes else np.zeros(0, dtype=np.int32)
        pointers = np.zeros(len(sizes), dtype=np.int64)
        np.cumsum(sizes[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        doc_idx = np.arange(len(sizes) + 1, dtype=np.int64)
        idx_tmp = Path(f"{self.idx_path}{self._tmp_suffix}")
        try:
            with open(idx_tmp, "wb") as out:
                out.write(HEADER.pack(MAGIC, VERSION, self._code, len(sizes), len(doc_idx)))
                out.write(sizes.astype("<i4").tobytes())
                out.write(pointers.astype("<i8").tobytes())
                out.write(doc_idx.astype("<i8").tobytes())
                out.flush()
                os.fsync(out.fileno())
            os.replace(self._bin_tmp, self.bin_path)
            os.replace(idx_tmp, self.idx_path)
        except BaseException:
            idx_tmp.unlink(missing_ok=True)  # no temporary file left behind (the .bin's: abort, or here)
            self._bin_tmp.unlink(missing_ok=True)
            raise
        fsync_dir(self.idx_path.parent)

    def abort(self) -> None:
        self._bin_file.close()
        self._bin_tmp.unlink(missing_ok=True)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()
