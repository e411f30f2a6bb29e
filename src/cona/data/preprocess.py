"""jsonl -> Megatron indexed dataset(s), one per JSON key: ``<prefix>_<key>_document.{bin,idx}``.

Tokenizers: GPT-2 BPE (vocab.json + merges.txt) or BERT's lower-case WordPiece (vocab.txt), see
:mod:`cona.data.tokenizer`; the token dtype follows the vocabulary size.

The input is read in chunks of lines; with ``workers > 1`` a process pool encodes them and the results
are written strictly in input order, so the output is byte-identical to a single-worker run. The EOD
(``<|endoftext|>``; [SEP] for WordPiece) appended by ``append_eod`` is counted in each document's size
(Megatron-DeepSpeed's preprocessor records the size before appending it; Megatron-LM fixed that, and so
do we). A blank line is no document and is passed over; any other line that is not a JSON object with a
string under each key is an error naming the file and line, or, with ``skip_bad_lines``, skipped and counted.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import json
import multiprocessing
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.pool import Pool
from pathlib import Path

import numpy as np

from cona.data.indexed import IndexedDatasetWriter, token_dtype
from cona.data.progress import ByteProgress
from cona.data.tokenizer import GPT2_BPE, cached_tokenizer, files_fingerprint, tokenizer_files
from cona.errors import DataError, not_found

CHUNK_BYTES = 1 << 18  # small enough to spread 10 MB over workers, large enough to amortise pickling
CHUNKS_IN_FLIGHT_PER_WORKER = 4  # bounds memory: the reader never runs far ahead of the writer


@dataclass(frozen=True, kw_only=True)
class PreprocessOptions:
    input: Path
    output_prefix: str
    vocab_file: Path
    merge_file: Path | None = None
    """GPT-2 merges.txt; only GPT2BPETokenizer reads one."""
    tokenizer_type: str = GPT2_BPE
    json_keys: tuple[str, ...] = ("text",)
    append_eod: bool = False
    workers: int = 1
    skip_bad_lines: bool = False


@dataclass(frozen=True, kw_only=True)
class PreprocessResult:
    outputs: dict[str, str]
    """JSON key -> output prefix (without .bin/.idx)."""
    documents: int
    tokens: dict[str, int]
    skipped_lines: int
    input_bytes: int
    seconds: float


@dataclass(frozen=True, kw_only=True)
class _EncodeSettings:
    input_name: str
    tokenizer_type: str
    tokenizer_files: tuple[str, ...]
    fingerprint: str
    json_keys: tuple[str, ...]
    append_eod: bool
    skip_bad_lines: bool
    dtype: str


@dataclass(frozen=True, kw_only=True)
class _Chunk:
    first_line: int
    lines: list[bytes]


@dataclass(frozen=True, kw_only=True)
class _EncodedChunk:
    tokens: dict[str, np.ndarray]
    sizes: dict[str, np.ndarray]
    skipped: int
    num_bytes: int


def output_prefix_for(output_prefix: str, key: str) -> str:
    return f"{output_prefix}_{key}_document"


def _read_chunks(path: Path) -> Iterator[_Chunk]:
    with open(path, "rb") as source:
        line_no = 1
        while True:
            lines = source.readlines(CHUNK_BYTES)
            if not lines:
                return
            yield _Chunk(first_line=line_no, lines=lines)
            line_no += len(lines)


def _parse_line(line: bytes, settings: _EncodeSettings) -> dict | str | None:
    """The decoded record, None for a blank line, or a string saying why the line is bad."""
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        return f"not valid JSON ({err.msg} at column {err.colno})"
    except UnicodeDecodeError:
        return "not valid UTF-8"
    if not isinstance(record, dict):
        return f"expected a JSON object, got {type(record).__name__}"
    for key in settings.json_keys:
        if key not in record:
            return f"no key {key!r} (--json-keys)"
        if not isinstance(record[key], str):
            return f"the value of {key!r} is {type(record[key]).__name__}, expected a string"
    return record


def _encode_chunk(settings: _EncodeSettings, chunk: _Chunk) -> _EncodedChunk:
    tokenizer = cached_tokenizer(settings.tokenizer_type, settings.tokenizer_files, settings.fingerprint)
    eod = [tokenizer.eod_id] if settings.append_eod else []
    encoded: dict[str, list[list[int]]] = {key: [] for key in settings.json_keys}
    skipped = 0
    for line_no, line in enumerate(chunk.lines, start=chunk.first_line):
        record = _parse_line(line, settings)
        if isinstance(record, str):
            if not settings.skip_bad_lines:
                raise DataError(
                    f"{settings.input_name}, line {line_no}: {record}; fix the line or pass --skip-bad-lines"
                )
            skipped += 1
            continue
        if record is None:
            continue
        for key in settings.json_keys:
            encoded[key].append(tokenizer.encode(record[key]) + eod)
    tokens = {
        key: np.fromiter(
            itertools.chain.from_iterable(docs), dtype=settings.dtype, count=sum(len(doc) for doc in docs)
        )
        for key, docs in encoded.items()
    }
    sizes = {key: np.array([len(doc) for doc in docs], dtype=np.int32) for key, docs in encoded.items()}
    num_bytes = sum(len(line) for line in chunk.lines)
    return _EncodedChunk(tokens=tokens, sizes=sizes, skipped=skipped, num_bytes=num_bytes)


def _encoded_in_order(
    settings: _EncodeSettings, path: Path, pool: Pool | None, workers: int
) -> Iterator[_EncodedChunk]:
    encode = functools.partial(_encode_chunk, settings)
    if pool is None:
        yield from map(encode, _read_chunks(path))
        return
    pending: collections.deque = collections.deque()
    for chunk in _read_chunks(path):
        pending.append(pool.apply_async(encode, (chunk,)))
        if len(pending) >= CHUNKS_IN_FLIGHT_PER_WORKER * workers:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def _worker_pool(workers: int) -> Pool:
    """Forked workers inherit the tokenizer the parent has just loaded (no start-up, no second load).

    The pool is made before the progress display starts its thread, while the parent only runs the
    main thread, as PyTorch's DataLoader does. Platforms without fork spawn workers that load their own.
    """
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    return multiprocessing.get_context(method).Pool(workers)


def preprocess(options: PreprocessOptions, *, show_progress: bool = True) -> PreprocessResult:
    """Tokenize ``options.input`` into one indexed dataset per JSON key; see the module docstring."""
    if not options.input.is_file():
        raise DataError(f"--input: {options.input} {not_found(options.input)}")
    if options.workers < 1:
        raise DataError(f"--workers: must be at least 1, got {options.workers}")
    if not options.json_keys:
        raise DataError("--json-keys: give at least one key")
    files = tokenizer_files(options.tokenizer_type, options.vocab_file, options.merge_file)
    fingerprint = files_fingerprint(files)
    names = tuple(str(path) for path in files)
    # Loaded here (and reused by the in-process encoder) so that bad files fail before any work starts.
    tokenizer = cached_tokenizer(options.tokenizer_type, names, fingerprint)
    settings = _EncodeSettings(
        input_name=str(options.input),
        tokenizer_type=options.tokenizer_type,
        tokenizer_files=names,
        fingerprint=fingerprint,
        json_keys=tuple(options.json_keys),
        append_eod=options.append_eod,
        skip_bad_lines=options.skip_bad_lines,
        dtype=token_dtype(tokenizer.vocab_size).str,
    )
    outputs = {key: output_prefix_for(options.output_prefix, key) for key in options.json_keys}
    out_dir = Path(options.output_prefix).parent
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DataError(f"--output-prefix: cannot create {out_dir}: {err.strerror or err}") from None
    input_bytes = options.input.stat().st_size
    started = time.perf_counter()
    skipped = 0
    with contextlib.ExitStack() as stack:
        pool = stack.enter_context(_worker_pool(options.workers)) if options.workers > 1 else None
        writers = {
            key: stack.enter_context(IndexedDatasetWriter(prefix, np.dtype(settings.dtype)))
            for key, prefix in outputs.items()
        }
        progress = stack.enter_context(
            ByteProgress(f"preprocess {options.input.name}", input_bytes, enabled=show_progress)
        )
        for chunk in _encoded_in_order(settings, options.input, pool, options.workers):
            for key, writer in writers.items():
                writer.add_documents(chunk.tokens[key], chunk.sizes[key])
            skipped += chunk.skipped
            progress.advance(chunk.num_bytes, documents=writers[options.json_keys[0]].num_documents)
        documents = writers[options.json_keys[0]].num_documents
        if documents == 0:
            raise DataError(
                f"--input: {options.input} holds no documents"
                + (f" ({skipped} bad lines skipped)" if skipped else "")
            )
    return PreprocessResult(
        outputs=outputs,
        documents=documents,
        tokens={key: writer.num_tokens for key, writer in writers.items()},
        skipped_lines=skipped,
        input_bytes=input_bytes,
        seconds=time.perf_counter() - started,
    )
