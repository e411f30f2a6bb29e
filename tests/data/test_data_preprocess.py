"""`cona preprocess` against reference encoders: the .bin must be tiktoken's ids (built directly from the
same vocab/merges files) + EOD, byte for byte, with 1 and 2 workers; HF tokenizers must agree."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest
import tiktoken
import tiktoken.load
from tests.helpers.text_data import (
    DEMO_DIR,
    ENGLISH_SAMPLE,
    real_gpt2_files,
    write_jsonl,
    write_tiny_gpt2_tokenizer,
)
from tiktoken_ext.openai_public import r50k_pat_str

from cona.cli import main
from cona.data import progress
from cona.data.indexed import IndexedDataset
from cona.data.preprocess import PreprocessOptions, preprocess
from cona.data.tokenizer import cached_gpt2_tokenizer, load_gpt2_tokenizer, tokenizer_fingerprint
from cona.errors import DataError


@functools.cache
def reference_encoding(vocab: Path, merges: Path) -> tiktoken.Encoding:
    """OpenAI's gpt2 encoding recipe (tiktoken_ext.openai_public.gpt2) pointed at local files."""
    ranks = tiktoken.load.data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=str(merges), encoder_json_file=str(vocab)
    )
    eod = json.loads(vocab.read_text(encoding="utf-8"))["<|endoftext|>"]
    return tiktoken.Encoding(
        name="reference", pat_str=r50k_pat_str, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": eod}
    )


def reference_bin(texts: list[str], encoding: tiktoken.Encoding) -> bytes:
    eod = encoding.eot_token
    ids = [i for text in texts for i in [*encoding.encode_ordinary(text), eod]]
    return np.array(ids, dtype="<u2").tobytes()


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[Path, Path]]:
    """The tiny tokenizer learnt from the sample, plus GPT-2's real files when the demo data exists."""
    tiny = write_tiny_gpt2_tokenizer(tmp_path_factory.mktemp("tiny"), "\n".join(ENGLISH_SAMPLE))
    real = real_gpt2_files()
    return [tiny, real] if real else [tiny]


def run(tmp_path: Path, records_or_path: list[dict] | Path, vocab: Path, merges: Path, **kwargs) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    source = (
        records_or_path
        if isinstance(records_or_path, Path)
        else write_jsonl(tmp_path / "in.jsonl", records_or_path)
    )
    workers = kwargs.pop("workers", 1)
    options = PreprocessOptions(
        input=source,
        output_prefix=str(tmp_path / f"out{workers}"),
        vocab_file=vocab,
        merge_file=merges,
        workers=workers,
        **kwargs,
    )
    return Path(preprocess(options, show_progress=False).outputs["text"])


def test_builtin_sample_matches_reference_ids_with_1_and_2_workers(tmp_path: Path, tokenizer_files) -> None:
    for n, (vocab, merges) in enumerate(tokenizer_files):
        expected = reference_bin(ENGLISH_SAMPLE, reference_encoding(vocab, merges))
        for workers in (1, 2):
            out = run(
                tmp_path / f"{n}",
                [{"text": t} for t in ENGLISH_SAMPLE],
                vocab,
                merges,
                append_eod=True,
                workers=workers,
            )
            assert Path(f"{out}.bin").read_bytes() == expected
            dataset = IndexedDataset(out)
            encoding = reference_encoding(vocab, merges)
            assert dataset.sizes.tolist() == [len(encoding.encode_ordinary(t)) + 1 for t in ENGLISH_SAMPLE]
            assert dataset.document(len(ENGLISH_SAMPLE) - 1)[-1] == encoding.eot_token


def test_hf_byte_level_bpe_gives_the_same_ids(tokenizer_files) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    for vocab, merges in tokenizer_files:
        hf = tokenizers.ByteLevelBPETokenizer(str(vocab), str(merges))
        ours = cached_gpt2_tokenizer(str(vocab), str(merges), tokenizer_fingerprint(vocab, merges))
        for text in ENGLISH_SAMPLE:
            assert ours.encode(text) == hf.encode(text).ids


def test_known_gpt2_ids() -> None:
    files = real_gpt2_files()
    if files is None:
        pytest.skip("GPT-2 files not obtained: run `cona data demo --out data/demo`")
    tokenizer = cached_gpt2_tokenizer(*map(str, files), tokenizer_fingerprint(*files))
    assert tokenizer.encode("The quick brown fox.") == [464, 2068, 7586, 21831, 13]
    assert (tokenizer.eod_id, tokenizer.vocab_size) == (50256, 50257)


def test_real_wiki_text_matches_reference_ids(tmp_path: Path) -> None:
    jsonl, files = DEMO_DIR / "wiki.jsonl", real_gpt2_files()
    if files is None or not jsonl.is_file():
        pytest.skip("demo data not obtained: run `cona data demo --out data/demo`")
    texts = [json.loads(line)["text"] for line in jsonl.read_text(encoding="utf-8").splitlines()]
    encoding = reference_encoding(*files)
    # The whole corpus (~10k articles, ~1 M tokens) with 2 workers ...
    out = run(tmp_path, jsonl, *files, append_eod=True, workers=2)
    assert Path(f"{out}.bin").read_bytes() == reference_bin(texts, encoding)
    assert IndexedDataset(out).num_documents == len(texts)
    # ... and with 1 worker over its first 1500 articles (the whole file again would only cost time).
    head = tmp_path / "head.jsonl"
    head.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:1500]), encoding="utf-8")
    out = run(tmp_path, head, *files, append_eod=True)
    assert Path(f"{out}.bin").read_bytes() == reference_bin(texts[:1500], encoding)
    tokenizers = pytest.importorskip("tokenizers")
    hf = tokenizers.ByteLevelBPETokenizer(str(files[0]), str(files[1]))
    assert all(hf.encode(text).ids == encoding.encode_ordinary(text) for text in texts[:500])


def test_without_append_eod_sizes_are_the_text_tokens(tmp_path: Path, tokenizer_files) -> None:
    vocab, merges = tokenizer_files[0]
    out = run(tmp_path, [{"text": "hello world"}, {"text": ""}], vocab, merges)
    encoding = reference_encoding(vocab, merges)
    assert IndexedDataset(out).sizes.tolist() == [len(encoding.encode_ordinary("hello world")), 0]


def test_each_json_key_gets_its_own_dataset(tmp_path: Path, tokenizer_files) -> None:
    vocab, merges = tokenizer_files[0]
    source = write_jsonl(
        tmp_path / "in.jsonl", [{"text": "a cat", "title": "Cats"}, {"text": "dogs", "title": "D"}]
    )
    options = PreprocessOptions(
        input=source,
        output_prefix=str(tmp_path / "multi"),
        vocab_file=vocab,
        merge_file=merges,
        json_keys=("text", "title"),
        append_eod=True,
    )
    result = preprocess(options, show_progress=False)
    encoding = reference_encoding(vocab, merges)
    title = IndexedDataset(tmp_path / "multi_title_document")
    assert result.outputs["title"] == str(tmp_path / "multi_title_document")
    assert title.document(0).tolist() == [*encoding.encode_ordinary("Cats"), encoding.eot_token]
    assert IndexedDataset(tmp_path / "multi_text_document").num_documents == 2


BAD_LINES = [
    ('{"text": "fine"}\n{"text": "broken\n', 2, "not valid JSON"),
    ('{"text": "fine"}\n\n{"body": "x"}\n', 3, "no key 'text'"),
    ("[1, 2]\n", 1, "expected a JSON object"),
    ('{"text": ["a", "b"]}\n', 1, "the value of 'text' is list"),
    (b'{"text": "ok"}\n{"text": "\xff\xfe"}\n'.decode("latin-1"), 2, "not valid UTF-8"),
]


@pytest.mark.parametrize(("content", "line", "why"), BAD_LINES)
def test_a_bad_line_is_an_error_naming_file_and_line(
    tmp_path: Path, tokenizer_files, content: str, line: int, why: str
) -> None:
    source = tmp_path / "bad.jsonl"
    source.write_bytes(content.encode("latin-1") if "UTF-8" in why else content.encode())
    with pytest.raises(DataError) as err:
        run(tmp_path, source, *tokenizer_files[0])
    assert f"{source}, line {line}: {why}" in str(err.value)
    assert not list(tmp_path.glob("out*"))  # no half-written dataset


def test_skip_bad_lines_keeps_the_good_ones_and_says_how_many(
    tmp_path: Path, tokenizer_files, capsys: pytest.CaptureFixture
) -> None:
    vocab, merges = tokenizer_files[0]
    source = tmp_path / "mixed.jsonl"
    source.write_text('{"text": "one"}\nnot json\n{"text": "two"}\n{"other": 1}\n{"text": "three"}\n')
    argv = [
        "preprocess",
        "--input",
        str(source),
        "--output-prefix",
        str(tmp_path / "mixed"),
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
        "1",
        "--skip-bad-lines",
    ]
    assert main(argv) == 0
    assert "skipped 2 malformed lines" in capsys.readouterr().out
    encoding = reference_encoding(vocab, merges)
    expected = reference_bin(["one", "two", "three"], encoding)
    assert (tmp_path / "mixed_text_document.bin").read_bytes() == expected


def test_cli_reports_a_bad_line_in_one_line(
    tmp_path: Path, tokenizer_files, capsys: pytest.CaptureFixture
) -> None:
    vocab, merges = tokenizer_files[0]
    source = tmp_path / "bad.jsonl"
    source.write_text('{"text": "one"}\n{"text": 1}\n')
    argv = [
        "preprocess",
        "--input",
        str(source),
        "--output-prefix",
        str(tmp_path / "o"),
        "--vocab-file",
        str(vocab),
        "--merge-file",
        str(merges),
    ]
    assert main(argv) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and f"{source}, line 2:" in error and "--skip-bad-lines" in error


def test_mismatched_tokenizer_files_are_refused(tmp_path: Path, tokenizer_files) -> None:
    vocab, _ = tokenizer_files[0]
    other_merges = tmp_path / "merges.txt"
    other_merges.write_text("#version: 0.2\nq z\n")
    with pytest.raises(DataError, match="not a matching GPT-2"):
        load_gpt2_tokenizer(vocab, other_merges)
    with pytest.raises(DataError, match="does not exist"):
        load_gpt2_tokenizer(tmp_path / "missing.json", other_merges)


def test_progress_is_plain_lines_when_stdout_is_not_a_terminal(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(progress, "PLAIN_INTERVAL_S", 0.0)
    with progress.ByteProgress("preprocess x.jsonl", 2 * progress.LONG_INPUT_BYTES) as bar:
        bar.advance(progress.LONG_INPUT_BYTES, documents=7)
    assert capsys.readouterr().out == "preprocess x.jsonl: 50% of 8.4 MB, 7 documents\n"
    with progress.ByteProgress("small.jsonl", 1000) as bar:
        bar.advance(1000, documents=1)
    assert capsys.readouterr().out == ""


def test_an_output_directory_that_cannot_be_made_is_one_line(
    tmp_path: Path, tokenizer_files, capsys: pytest.CaptureFixture
) -> None:
    vocab, merges = tokenizer_files[0]
    source = tmp_path / "in.jsonl"
    source.write_text('{"text": "one"}\n')
    (tmp_path / "a-file").write_text("")
    prefix = tmp_path / "a-file" / "sub" / "o"
    argv = ["preprocess", "--input", str(source), "--output-prefix", str(prefix)]
    assert main([*argv, "--vocab-file", str(vocab), "--merge-file", str(merges)]) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and f"--output-prefix: cannot create {prefix.parent}" in error


def test_inspect_decodes_a_document_with_the_flags_or_the_config_s_tokenizer(
    tmp_path: Path, tokenizer_files, capsys, monkeypatch
) -> None:
    vocab, merges = tokenizer_files[0]
    out = run(tmp_path, [{"text": "the cat sat"}, {"text": "on the mat."}], vocab, merges, append_eod=True)
    files = ["--vocab-file", str(vocab), "--merge-file", str(merges)]
    monkeypatch.chdir(tmp_path)  # no .conaconfig here or above: the flags name the tokenizer
    assert main(["data", "inspect", str(out), "--doc", "1", *files]) == 0
    assert "document 1 text: 'on the mat.<|endoftext|>'" in capsys.readouterr().out
    assert main(["data", "inspect", str(out), "--doc", "0", "--json", *files]) == 0
    assert json.loads(capsys.readouterr().out)["doc"]["text"] == "the cat sat<|endoftext|>"

    config = {"model": {"layers": 1, "hidden": 8, "heads": 1, "seq": 8}}
    config["training"] = {"vocab_file": str(vocab), "merge_file": str(merges)}
    (tmp_path / ".conaconfig").write_text(json.dumps(config))
    assert main(["data", "inspect", str(out), "--doc", "0"]) == 0
    assert "document 0 text: 'the cat sat<|endoftext|>'" in capsys.readouterr().out
