"""Helpers for the data tests: a small English sample, a tiny GPT-2-format tokenizer learnt from it, and
where the real GPT-2 files are when the demo data has been obtained (scripts/install.sh)."""

from __future__ import annotations

import collections
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEMO_DIR = ROOT / "data" / "demo"

ENGLISH_SAMPLE = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital and most populous city of France, with an estimated population of 2,102,650 "
    "residents in January 2023 in an area of more than 105 km2.",
    "Water is an inorganic compound with the chemical formula H2O. It is a transparent, tasteless, odorless, "
    "and nearly colorless chemical substance.",
    "  Leading spaces, trailing spaces   and\ttabs\nand new lines\n\nstay exactly as they are.  ",
    "Numbers like 3.14159, dates like 1969-07-20 and symbols like $, %, & and # are split by the pattern.",
    "Unicode: café, naïve, Zürich, Ελληνικά, 日本語, and an emoji 🚀 all become byte-level tokens.",
    "Contractions: don't, we'll, they're, I've, she'd; and a literal <|endoftext|> is plain text here.",
    "",
    "In 1905 Albert Einstein published four papers that changed physics: the photoelectric effect, "
    "Brownian motion, special relativity, and mass-energy equivalence.",
]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map used in vocab.json and merges.txt."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def write_tiny_gpt2_tokenizer(directory: Path, text: str, num_merges: int = 80) -> tuple[Path, Path]:
    """Learn ``num_merges`` BPE merges from ``text`` and write GPT-2-format vocab.json + merges.txt.

    Byte tokens get the ids GPT-2 gives them (printable bytes first), merges follow in order and
    ``<|endoftext|>`` is last, so the pair has the same structure as GPT-2's real files.
    """
    byte_char = bytes_to_unicode()
    words = collections.Counter(re.findall(r" ?\w+| ?[^\s\w]+|\s+", text))
    symbols = {word: tuple(byte_char[b] for b in word.encode()) for word in words}
    vocab = {
        byte_char[b]: i for i, b in enumerate(sorted(byte_char, key=lambda b: (ord(byte_char[b]) > 255, b)))
    }
    merges: list[tuple[str, str]] = []
    while len(merges) < num_merges:
        pairs: collections.Counter = collections.Counter()
        for word, parts in symbols.items():
            for pair in zip(parts, parts[1:], strict=False):
                pairs[pair] += words[word]
        candidates = [p for p, n in pairs.items() if n >= 2 and p[0] + p[1] not in vocab]
        if not candidates:
            break
        best = max(candidates, key=lambda p: (pairs[p], p))
        merges.append(best)
        vocab[best[0] + best[1]] = len(vocab)
        symbols = {word: _merge(parts, best) for word, parts in symbols.items()}
    vocab["<|endoftext|>"] = len(vocab)
    directory.mkdir(parents=True, exist_ok=True)
    vocab_path, merge_path = directory / "vocab.json", directory / "merges.txt"
    vocab_path.write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    merge_path.write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    return vocab_path, merge_path


def _merge(parts: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    merged: list[str] = []
    i = 0
    while i < len(parts):
        if i + 1 < len(parts) and (parts[i], parts[i + 1]) == pair:
            merged.append(parts[i] + parts[i + 1])
            i += 2
        else:
            merged.append(parts[i])
            i += 1
    return tuple(merged)


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def real_gpt2_files() -> tuple[Path, Path] | None:
    """The GPT-2 vocab.json/merges.txt that `cona data demo` put in data/demo, if present."""
    vocab, merges = DEMO_DIR / "gpt2-vocab.json", DEMO_DIR / "gpt2-merges.txt"
    return (vocab, merges) if vocab.is_file() and merges.is_file() else None
