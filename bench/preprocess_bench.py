"""Throughput of `cona preprocess` (1 and 2 workers) against a plain tiktoken loop, measured in one run.

Input: the demo Wikipedia text (data/demo/wiki.jsonl, from `cona data demo --out data/demo`) repeated
until it reaches --megabytes, in a temporary directory. `cona preprocess` runs as a subprocess, so its
time includes interpreter start-up, imports and loading the tokenizer; it is also timed in-process with
the tokenizer loaded, like the reference loop (json.loads + encode_ordinary per line, GPT-2 built by
tiktoken from the same files, + EOD).

    .venv/bin/python bench/preprocess_bench.py [--megabytes 10] [--demo-dir data/demo]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import tiktoken
import tiktoken.load
from tiktoken_ext.openai_public import r50k_pat_str

from cona.data.indexed import IndexedDataset
from cona.data.preprocess import PreprocessOptions, preprocess
from cona.data.tokenizer import cached_gpt2_tokenizer, tokenizer_fingerprint

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True, kw_only=True)
class Measurement:
    name: str
    workers: int
    seconds: float
    documents: int
    tokens: int


def make_input(wiki: Path, target_bytes: int, out: Path) -> int:
    """Repeat the wiki lines until the file holds ``target_bytes``; returns the number of documents."""
    lines = wiki.read_bytes().splitlines(keepends=True)
    written = documents = 0
    with open(out, "wb") as sink:
        while written < target_bytes:
            for line in lines:
                sink.write(line)
                written += len(line)
                documents += 1
                if written >= target_bytes:
                    break
    return documents


def tiktoken_loop(jsonl: Path, vocab: Path, merges: Path) -> Measurement:
    ranks = tiktoken.load.data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=str(merges), encoder_json_file=str(vocab)
    )
    encoding = tiktoken.Encoding(
        name="gpt2-local",
        pat_str=r50k_pat_str,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": 50256},
    )
    started = time.perf_counter()
    documents = tokens = 0
    with open(jsonl, "rb") as source:
        for line in source:
            tokens += len(encoding.encode_ordinary(json.loads(line)["text"])) + 1  # + EOD, as --append-eod
            documents += 1
    return Measurement(
        name="tiktoken loop (reference)",
        workers=1,
        seconds=time.perf_counter() - started,
        documents=documents,
        tokens=tokens,
    )


def cona_preprocess(jsonl: Path, vocab: Path, merges: Path, workers: int, out_dir: Path) -> Measurement:
    prefix = out_dir / f"bench{workers}"
    command = [
        sys.executable,
        "-m",
        "cona",
        "preprocess",
        "--input",
        str(jsonl),
        "--output-prefix",
        str(prefix),
        "--vocab-file",
        str(vocab),
        "--merge-file",
        str(merges),
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--dataset-impl",
        "mmap",
        "--append-eod",
        "--workers",
        str(workers),
    ]
    started = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True)
    seconds = time.perf_counter() - started
    idx = Path(f"{prefix}_text_document.idx")
    dataset = IndexedDataset(idx.with_suffix(""))
    return Measurement(
        name="cona preprocess",
        workers=workers,
        seconds=seconds,
        documents=dataset.num_documents,
        tokens=dataset.num_tokens,
    )


def in_process(jsonl: Path, vocab: Path, merges: Path, workers: int, out_dir: Path) -> Measurement:
    """The same work without interpreter start-up and with the tokenizer already loaded (as the reference)."""
    options = PreprocessOptions(
        input=jsonl,
        output_prefix=str(out_dir / f"inproc{workers}"),
        vocab_file=vocab,
        merge_file=merges,
        append_eod=True,
        workers=workers,
    )
    cached_gpt2_tokenizer(str(vocab), str(merges), tokenizer_fingerprint(vocab, merges))
    result = preprocess(options, show_progress=False)
    return Measurement(
        name="preprocess() in-process, tokenizer loaded",
        workers=workers,
        seconds=result.seconds,
        documents=result.documents,
        tokens=result.tokens["text"],
    )


def print_table(rows: list[Measurement], megabytes: float) -> None:
    reference = rows[0]
    print(
        f"input: {megabytes:.1f} MB, {reference.documents} documents, "
        f"{reference.tokens} tokens (EOD included)"
    )
    print("| method | workers | seconds | documents/s | tokens/s | tokens/s vs tiktoken loop |")
    print("|---|---:|---:|---:|---:|---:|")
    for row in rows:
        rate = row.tokens / row.seconds
        print(
            f"| {row.name} | {row.workers} | {row.seconds:.2f} | {row.documents / row.seconds:,.0f} | "
            f"{rate:,.0f} | {rate / (reference.tokens / reference.seconds):.2f} |"
        )


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=float, default=10.0)
    parser.add_argument("--demo-dir", type=Path, default=ROOT / "data" / "demo")
    args = parser.parse_args()
    wiki, vocab, merges = (
        args.demo_dir / name for name in ("wiki.jsonl", "gpt2-vocab.json", "gpt2-merges.txt")
    )
    if not all(path.is_file() for path in (wiki, vocab, merges)):
        print(f"{args.demo_dir} lacks the demo data: run `cona data demo --out {args.demo_dir}` first")
        return 2
    with tempfile.TemporaryDirectory(prefix="cona-bench-") as tmp:
        jsonl = Path(tmp) / "input.jsonl"
        make_input(wiki, int(args.megabytes * 1e6), jsonl)
        rows = [tiktoken_loop(jsonl, vocab, merges)]
        rows += [cona_preprocess(jsonl, vocab, merges, workers, Path(tmp)) for workers in (1, 2)]
        rows += [in_process(jsonl, vocab, merges, workers, Path(tmp)) for workers in (1, 2)]
        same = (
            Path(tmp, "bench1_text_document.bin").read_bytes()
            == Path(tmp, "bench2_text_document.bin").read_bytes()
        )
        print_table(rows, jsonl.stat().st_size / 1e6)
        print(
            f"1-worker and 2-worker .bin identical: {same}; token counts equal the reference: "
            f"{all(row.tokens == rows[0].tokens for row in rows)}"
        )
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
