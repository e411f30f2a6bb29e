"""The one JSON-lines reader: whole-file reads with each line's number and error, and the tail that never
returns a torn line."""

from __future__ import annotations

from pathlib import Path

from cona.jsonl import JsonlTail, read_lines, read_records


def test_read_lines_numbers_each_line_and_flags_the_unterminated_last(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"a": 1}\n\n[1, 2]\nnot json\n{"b": "\xff"}\n{"c": ')
    lines = read_lines(path)
    assert [line.number for line in lines] == [1, 3, 4, 5, 6]  # the blank line 2 is skipped
    assert lines[0].value == {"a": 1} and lines[1].value == [1, 2]
    assert lines[2].error is not None and not lines[2].unterminated
    assert lines[3].value == {"b": "\ufffd"}  # a bad byte reads as U+FFFD, not as an exception
    assert lines[4].error is not None and lines[4].unterminated
    assert read_records(path) == [{"a": 1}, {"b": "\ufffd"}]


def test_a_missing_file_reads_as_empty(tmp_path: Path) -> None:
    assert read_lines(tmp_path / "none.jsonl") == [] and read_records(tmp_path / "none.jsonl") == []


def test_a_complete_last_line_without_newline_is_read_whole(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"a": 1}\n{"a": 2}')
    assert read_records(path) == [{"a": 1}, {"a": 2}]


def test_the_tail_holds_back_a_half_written_line(tmp_path: Path) -> None:
    path = tmp_path / "decisions.jsonl"
    tail = JsonlTail(path)
    assert tail.new_records() == []
    with open(path, "w") as handle:
        handle.write('{"a": 1}\n{"a": ')
        handle.flush()
        assert tail.new_records() == [{"a": 1}]
        handle.write('2}\n"a string"\n')
        handle.flush()
        assert tail.new_records() == [{"a": 2}]
    assert JsonlTail.at_end(path).new_records() == []
