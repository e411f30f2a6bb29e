"""The mmap indexed dataset against the format spec: an independent writer, field-by-field checks of our
.idx, every refused kind of broken file, and `cona data inspect`."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from cona.cli import main
from cona.data.indexed import IndexedDataset, IndexedDatasetWriter, token_dtype
from cona.errors import DataError


def write_by_spec(
    prefix: Path,
    sequences: list[list[int]],
    doc_idx: list[int],
    *,
    dtype: str = "<u2",
    code: int = 8,
    magic: bytes = b"MMIDIDX\x00\x00",
    version: int = 1,
) -> None:
    """A minimal writer straight from the spec (struct + numpy), independent of cona's writer."""
    sizes = [len(s) for s in sequences]
    itemsize = np.dtype(dtype).itemsize
    pointers = [sum(sizes[:i]) * itemsize for i in range(len(sizes))]
    header = magic + struct.pack("<Q", version) + struct.pack("<B", code)
    header += struct.pack("<Q", len(sizes)) + struct.pack("<Q", len(doc_idx))
    body = struct.pack(f"<{len(sizes)}i", *sizes) + struct.pack(f"<{len(sizes)}q", *pointers)
    body += struct.pack(f"<{len(doc_idx)}q", *doc_idx)
    Path(f"{prefix}.idx").write_bytes(header + body)
    Path(f"{prefix}.bin").write_bytes(b"".join(np.array(s, dtype=dtype).tobytes() for s in sequences))


SEQUENCES = [[5, 6, 7], [50256], [], [1, 2, 3, 4, 65000], [9, 9]]


def test_reads_a_pair_written_by_an_independent_implementation(tmp_path: Path) -> None:
    prefix = tmp_path / "ref"
    # Five sequences in three documents: [0, 2), [2, 4), [4, 5) -- as sentence splitting would make.
    write_by_spec(prefix, SEQUENCES, [0, 2, 4, 5])
    dataset = IndexedDataset(prefix)
    assert len(dataset) == 5
    assert dataset.num_documents == 3
    assert dataset.num_tokens == 11
    assert dataset.dtype == np.uint16
    for i, expected in enumerate(SEQUENCES):
        assert dataset[i].tolist() == expected
    assert dataset.get(3, offset=1, length=2).tolist() == [2, 3]
    assert dataset.get(3, offset=3, length=10).tolist() == [4, 65000]
    assert dataset.document(1).tolist() == [1, 2, 3, 4, 65000]
    assert dataset.document(0).tolist() == [5, 6, 7, 50256]


def test_reads_int32_tokens(tmp_path: Path) -> None:
    write_by_spec(tmp_path / "wide", [[70000, 1], [2]], [0, 1, 2], dtype="<i4", code=4)
    dataset = IndexedDataset(tmp_path / "wide")
    assert dataset.dtype == np.int32
    assert dataset.document(0).tolist() == [70000, 1]


def test_writer_output_matches_the_spec_field_by_field(tmp_path: Path) -> None:
    documents = [[464, 2068, 7586, 50256], [13, 50256], [0, 65535, 50256]]
    with IndexedDatasetWriter(tmp_path / "ours", np.uint16) as writer:
        for doc in documents:
            writer.add_document(doc)
    raw = (tmp_path / "ours.idx").read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack_from("<Q", raw, 9) == (1,)
    assert raw[17] == 8  # uint16
    n, d = struct.unpack_from("<QQ", raw, 18)
    assert (n, d) == (3, 4)
    assert struct.unpack_from("<3i", raw, 34) == (4, 2, 3)
    assert struct.unpack_from("<3q", raw, 34 + 4 * 3) == (0, 8, 12)
    assert struct.unpack_from("<4q", raw, 34 + 12 * 3) == (0, 1, 2, 3)
    assert len(raw) == 34 + 12 * 3 + 8 * 4
    expected_bin = struct.pack("<9H", *[t for doc in documents for t in doc])
    assert (tmp_path / "ours.bin").read_bytes() == expected_bin


@pytest.mark.parametrize(("dtype", "code"), [("<f4", 7), ("<f8", 6)])
def test_float_token_data_is_refused_naming_the_file(tmp_path: Path, dtype: str, code: int) -> None:
    """Float ids would be cut to an integer (3993.5 -> 3993) or be NaN; the reader and the writer refuse
    them, naming the file."""
    prefix = tmp_path / "floats"
    write_by_spec(prefix, [[1.0, 3993.5], [float("nan")]], [0, 1, 2], dtype=dtype, code=code)
    name = np.dtype(dtype).name
    with pytest.raises(DataError, match=rf"^{prefix}.idx: dtype code {code} is {name}, a float type; "):
        IndexedDataset(prefix)
    with pytest.raises(DataError, match=f"dtype {name} cannot hold token ids"):
        IndexedDatasetWriter(tmp_path / "written", np.dtype(dtype))


def test_writer_leaves_nothing_behind_when_it_fails(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), IndexedDatasetWriter(tmp_path / "broken", np.uint16) as writer:
        writer.add_document([1, 2])
        raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []


def test_writer_refuses_ids_that_do_not_fit(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="65536"), IndexedDatasetWriter(tmp_path / "x", np.uint16) as writer:
        writer.add_document([65536])


@pytest.mark.parametrize(
    ("vocab_size", "dtype"), [(50257, np.uint16), (65499, np.uint16), (65500, np.int32), (128256, np.int32)]
)
def test_token_dtype_follows_megatron(vocab_size: int, dtype: type) -> None:
    assert token_dtype(vocab_size) == np.dtype(dtype)


def _corrupt(prefix: Path, how: str) -> str:
    """Break a valid pair in one way; returns a phrase the error message must contain."""
    idx, bin_ = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    raw = bytearray(idx.read_bytes())
    if how == "magic":
        raw[:9] = b"NOTANIDX\x00"
        idx.write_bytes(raw)
        return "magic"
    if how == "legacy":
        idx.write_bytes(b"TNTIDX\x00\x00" + bytes(raw[8:]))
        return "legacy"
    if how == "version":
        raw[9:17] = struct.pack("<Q", 2)
        idx.write_bytes(raw)
        return "version 2"
    if how in ("dtype-high", "dtype-zero"):
        raw[17] = 9 if how == "dtype-high" else 0
        idx.write_bytes(raw)
        return "dtype code"
    if how == "truncated-header":
        idx.write_bytes(raw[:20])
        return "truncated"
    if how == "truncated-arrays":
        idx.write_bytes(raw[:-5])
        return "truncated"
    if how == "bin-short":
        bin_.write_bytes(bin_.read_bytes()[:-2])
        return "shorter"
    if how == "bin-long":
        bin_.write_bytes(bin_.read_bytes() + b"\x00\x00")
        return "longer"
    if how == "pointers":
        struct.pack_into("<q", raw, 34 + 4 * 5 + 8, 3)
        idx.write_bytes(raw)
        return "pointer of sequence 1"
    if how == "doc-idx":
        struct.pack_into("<q", raw, len(raw) - 8, 4)
        idx.write_bytes(raw)
        return "doc_idx"
    raise AssertionError(how)


@pytest.mark.parametrize(
    "how",
    [
        "magic",
        "legacy",
        "version",
        "dtype-high",
        "dtype-zero",
        "truncated-header",
        "truncated-arrays",
        "bin-short",
        "bin-long",
        "pointers",
        "doc-idx",
    ],
)
def test_broken_files_give_a_data_error_naming_the_file(tmp_path: Path, how: str) -> None:
    prefix = tmp_path / "data"
    write_by_spec(prefix, SEQUENCES, [0, 1, 2, 3, 4, 5])
    IndexedDataset(prefix)  # valid before the damage
    phrase = _corrupt(prefix, how)
    with pytest.raises(DataError) as err:
        IndexedDataset(prefix)
    message = str(err.value)
    assert phrase in message
    assert str(prefix) in message


def test_missing_file_is_named(tmp_path: Path) -> None:
    write_by_spec(tmp_path / "d", SEQUENCES, [0, 1, 2, 3, 4, 5])
    (tmp_path / "d.bin").unlink()
    with pytest.raises(DataError, match=r"d\.bin.*does not exist"):
        IndexedDataset(tmp_path / "d")


def test_inspect_prints_counts_dtype_and_a_document(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    write_by_spec(tmp_path / "d", SEQUENCES, [0, 2, 4, 5])
    assert main(["data", "inspect", str(tmp_path / "d"), "--json", "--doc", "1"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["documents"], summary["sequences"], summary["tokens"], summary["dtype"]) == (
        3,
        5,
        11,
        "uint16",
    )
    assert summary["doc"] == {"index": 1, "ids": [1, 2, 3, 4, 65000]}
    assert main(["data", "inspect", str(tmp_path / "d"), "--doc", "2"]) == 0
    text = capsys.readouterr().out
    assert "documents: 3" in text and "tokens: 11" in text and "dtype: uint16" in text
    assert "document 2 (2 tokens): 9 9" in text


def test_inspect_refuses_a_document_out_of_range(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    write_by_spec(tmp_path / "d", SEQUENCES, [0, 2, 4, 5])
    assert main(["data", "inspect", str(tmp_path / "d"), "--doc", "3"]) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "--doc: 3 is out of range" in error


def test_accepts_the_sequence_modes_newer_megatron_core_appends(tmp_path: Path) -> None:
    write_by_spec(tmp_path / "m", SEQUENCES, [0, 1, 2, 3, 4, 5])
    with open(tmp_path / "m.idx", "ab") as idx:
        idx.write(bytes(len(SEQUENCES)))  # int8[N] sequence modes
    assert IndexedDataset(tmp_path / "m").document(3).tolist() == [1, 2, 3, 4, 65000]
