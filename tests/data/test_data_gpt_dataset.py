"""GPT samples and the sampler: Megatron's split, packing with shared boundary tokens, per-epoch shuffles
that never depend on the run length, the .npy cache, and the data-order invariance across (dp, mbs, gbs)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from cona.config import ConaConfig, parse_config
from cona.data.gpt_dataset import (
    GPTDataset,
    build_datasets,
    collate,
    micro_batch_sample_ids,
)
from cona.data.indexed import IndexedDatasetWriter
from cona.data.split_ranges import split_document_ranges
from cona.errors import DataError, LayoutError

SEQ = 16


def write_documents(prefix: Path, lengths: list[int]) -> list[np.ndarray]:
    """Documents whose tokens say where they come from: document d, position p -> 100 * d + p."""
    docs = [np.arange(length, dtype=np.int64) + 100 * d for d, length in enumerate(lengths)]
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for doc in docs:
            writer.add_document(doc)
    return docs


def make_config(tmp_path: Path, **training) -> ConaConfig:
    raw = {
        "model": {"layers": 1, "hidden": 8, "heads": 1, "seq": training.pop("seq", SEQ), "vocab_size": 65000},
        "training": {
            "data_prefix": str(tmp_path / "docs"),
            "split": "80,15,5",
            "seed": 7,
            "data_cache_path": str(tmp_path / "cache"),
            **training,
        },
    }
    return parse_config(raw, source=tmp_path / ".conaconfig")


@pytest.fixture
def corpus(tmp_path: Path) -> list[np.ndarray]:
    lengths = np.random.default_rng(0).integers(1, 40, size=60).tolist()
    lengths[5] = lengths[6] = lengths[59] = 0  # empty documents must be stepped over
    return write_documents(tmp_path / "docs", lengths)


@pytest.mark.parametrize(
    ("documents", "split", "expected"),
    [
        (1000, "949,50,1", [(0, 949), (949, 999), (999, 1000)]),
        (10033, "949,50,1", [(0, 9521), (9521, 10023), (10023, 10033)]),
        (10, "1,1,1", [(0, 4), (4, 7), (7, 10)]),
        (7, "100,0,0", [(0, 7), (7, 7), (7, 7)]),
        (20, "8/1/1", [(0, 16), (16, 18), (18, 20)]),
    ],
)
def test_split_follows_megatron(documents: int, split: str, expected: list[tuple[int, int]]) -> None:
    assert split_document_ranges(documents, split) == expected


def epoch_windows(dataset: GPTDataset, corpus: list[np.ndarray], epoch: int) -> list[np.ndarray]:
    """The epoch's samples in stream order, cut from the documents directly (not from the index)."""
    order = dataset.epoch_index(epoch).doc_order
    assert sorted(order.tolist()) == list(range(*dataset.documents))
    stream = np.concatenate([corpus[d] for d in order])
    return [stream[k * SEQ : k * SEQ + SEQ + 1] for k in range(len(dataset))]


def test_samples_are_shuffled_windows_of_the_packed_epoch(tmp_path: Path, corpus) -> None:
    train = build_datasets(make_config(tmp_path)).train
    assert len(train) == (train.num_tokens - 1) // SEQ
    for epoch in (0, 1):
        windows = epoch_windows(train, corpus, epoch)
        shuffle = train.epoch_index(epoch).shuffle
        assert sorted(shuffle.tolist()) == list(range(len(train)))
        for local in range(len(train)):
            sample = train[epoch * len(train) + local]
            assert sample.dtype == np.int64 and len(sample) == SEQ + 1
            np.testing.assert_array_equal(sample, windows[shuffle[local]])
        # Neighbouring windows share exactly one boundary token.
        assert all(a[-1] == b[0] for a, b in zip(windows, windows[1:], strict=False))
    assert not np.array_equal(train.epoch_index(0).doc_order, train.epoch_index(1).doc_order)


def test_order_does_not_depend_on_run_length_or_access_order(tmp_path: Path, corpus) -> None:
    first = build_datasets(make_config(tmp_path)).train
    short_run = [first[i] for i in range(len(first) // 2)]
    other = build_datasets(make_config(tmp_path, data_cache_path=str(tmp_path / "other-cache"))).train
    far = [other[i] for i in range(3 * len(other) + 5, 3 * len(other) - 5, -1)]  # epoch 3 first, backwards
    long_run = [other[i] for i in range(3 * len(other) + 6)]
    for a, b in zip(short_run, long_run, strict=False):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(far, reversed(long_run[-10:]), strict=True):
        np.testing.assert_array_equal(a, b)


def test_index_is_cached_and_reused(tmp_path: Path, corpus, monkeypatch: pytest.MonkeyPatch) -> None:
    config = make_config(tmp_path)
    built = build_datasets(config).train
    expected = [built[i] for i in range(2 * len(built))]
    cached = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert all(name.endswith((".npy", "_sha256.json")) for name in cached)
    assert len([name for name in cached if "_train_" in name]) == 2 * 4  # 2 epochs x (3 arrays + checksums)
    assert len(cached) == 2 * 4 + 4 + 4  # + epoch 0 of valid and test, built up front

    def no_build(self, epoch):
        raise AssertionError("the index should have come from the cache")

    monkeypatch.setattr(GPTDataset, "_build", no_build)
    reloaded = build_datasets(config).train
    for i, sample in enumerate(expected):
        np.testing.assert_array_equal(reloaded[i], sample)


def test_cache_key_covers_what_the_index_depends_on(tmp_path: Path, corpus) -> None:
    base = build_datasets(make_config(tmp_path)).train.cache_paths(0)
    for change in ({"seed": 8}, {"seq": 8}, {"split": "70,25,5"}):
        assert build_datasets(make_config(tmp_path, **change)).train.cache_paths(0) != base
    splits = build_datasets(make_config(tmp_path))
    assert splits.valid.cache_paths(0) != base and splits.train.cache_paths(1) != base
    os.utime(tmp_path / "docs.bin", ns=(0, 0))  # rewritten data -> new key
    assert build_datasets(make_config(tmp_path)).train.cache_paths(0) != base


def test_a_damaged_cache_file_is_rebuilt(tmp_path: Path, corpus) -> None:
    config = make_config(tmp_path)
    expected = build_datasets(config).train[3]
    for path in (tmp_path / "cache").glob("*_shuffle.npy"):
        path.write_bytes(b"garbage")
    np.testing.assert_array_equal(build_datasets(config).train[3], expected)
    assert not list((tmp_path / "cache").glob("*.tmp"))


@pytest.mark.parametrize("damage", ["zeroed", "swapped", "no checksums"])
def test_a_cached_array_of_the_right_shape_but_other_values_is_rebuilt(
    tmp_path: Path, corpus, damage
) -> None:
    """Zeroing ``*_train_shuffle.npy`` keeps its shape; read as it is, the run would repeat samples."""
    config = make_config(tmp_path)
    built = build_datasets(config).train
    expected = [built[i] for i in range(len(built))]
    shuffle = next((tmp_path / "cache").glob("*_train_shuffle.npy"))
    if damage == "zeroed":
        np.save(shuffle, np.zeros_like(np.load(shuffle)))
    elif damage == "swapped":
        order = np.load(shuffle)
        np.save(shuffle, np.concatenate([order[1::-1], order[2:]]))  # the first two visited samples swapped
    else:  # a cache an older version wrote, or a checksum file lost: the arrays are not trusted
        next((tmp_path / "cache").glob("*_train_sha256.json")).unlink()
        np.save(shuffle, np.zeros_like(np.load(shuffle)))
    reloaded = build_datasets(config).train
    for i, sample in enumerate(expected):
        np.testing.assert_array_equal(reloaded[i], sample)
    assert not np.array_equal(np.load(shuffle), np.zeros_like(np.load(shuffle)))  # rewritten


def test_default_cache_dir_is_next_to_the_data(tmp_path: Path, corpus) -> None:
    raw = {
        "model": {"layers": 1, "hidden": 8, "heads": 1, "seq": SEQ, "vocab_size": 65000},
        "training": {"data_prefix": str(tmp_path / "docs")},
    }
    build_datasets(parse_config(raw, source=tmp_path / ".conaconfig"))
    assert len(list((tmp_path / "index-cache").glob("*_train_*.npy"))) == 3


def test_split_and_size_errors(tmp_path: Path, corpus) -> None:
    with pytest.raises(DataError, match=r"training\.split '0,1,0' leaves the train split no documents"):
        build_datasets(make_config(tmp_path, split="0,1,0"))
    with pytest.raises(DataError, match=r"too few for one sample of model\.seq \+ 1 = 100001"):
        build_datasets(make_config(tmp_path, seq=100000))
    only_train = build_datasets(make_config(tmp_path, split="1,0,0"))
    assert only_train.valid is None and only_train.test is None
    (tmp_path / "not-a-dir").write_text("")
    with pytest.raises(DataError, match=r"training\.data_cache_path"):
        build_datasets(make_config(tmp_path, data_cache_path=str(tmp_path / "not-a-dir" / "x")))
    raw = {"model": {"layers": 1, "hidden": 8, "heads": 1, "seq": SEQ}, "training": {}}
    with pytest.raises(DataError, match=r"training\.data_prefix is not set"):
        build_datasets(parse_config(raw, source=tmp_path / ".conaconfig"))


def test_collate_gives_shifted_int64_batches(tmp_path: Path, corpus) -> None:
    train = build_datasets(make_config(tmp_path)).train
    ids = np.array([5, 0, 17])
    inputs, targets = collate(train, ids)
    assert inputs.shape == targets.shape == (3, SEQ)
    assert str(inputs.dtype) == str(targets.dtype) == "torch.int64"
    for row, sample_id in enumerate(ids):
        np.testing.assert_array_equal(inputs[row].numpy(), train[sample_id][:-1])
        np.testing.assert_array_equal(targets[row].numpy(), train[sample_id][1:])


def test_a_rank_gets_its_slice_of_each_micro_step() -> None:
    batches = micro_batch_sample_ids(consumed_samples=16, gbs=8, mbs=2, dp=2, dp_rank=1)
    assert [b.tolist() for b in batches] == [[18, 19], [22, 23]]
    with pytest.raises(LayoutError, match="gbs 10 is not a positive multiple of mbs \\* dp = 2 \\* 2"):
        micro_batch_sample_ids(0, gbs=10, mbs=2, dp=2, dp_rank=0)
    with pytest.raises(LayoutError, match="dp rank 2"):
        micro_batch_sample_ids(0, gbs=8, mbs=2, dp=2, dp_rank=2)


# Runs that switch strategy at step boundaries: (dp, mbs, gbs, steps) per phase.
SWITCH_SEQUENCES = [
    [(1, 1, 8, 3), (2, 2, 8, 2), (4, 1, 8, 2), (8, 1, 8, 1)],
    [(2, 4, 16, 2), (1, 16, 16, 1), (4, 2, 16, 3)],
    [(1, 2, 8, 2), (2, 2, 16, 2), (4, 2, 32, 1), (2, 1, 8, 3)],
    [(3, 1, 6, 2), (1, 3, 6, 2), (2, 3, 12, 2), (6, 1, 12, 1)],
    [(8, 1, 8, 1), (1, 1, 8, 1), (2, 4, 8, 1), (4, 2, 24, 2), (1, 6, 24, 1)],
    [(1, 1, 1, 5), (1, 1, 2, 3), (2, 1, 2, 2), (1, 1, 4, 1)],
]


def step_ids(consumed: int, dp: int, mbs: int, gbs: int) -> list[int]:
    ids = []
    for rank in range(dp):
        micro_batches = micro_batch_sample_ids(consumed, gbs, mbs, dp, rank)
        assert len(micro_batches) == gbs // (mbs * dp) and all(len(b) == mbs for b in micro_batches)
        ids.extend(int(i) for batch in micro_batches for i in batch)
    return ids


@pytest.mark.parametrize("phases", SWITCH_SEQUENCES)
def test_switching_strategies_neither_skips_nor_repeats_a_sample(phases) -> None:
    consumed, seen = 0, []
    for dp, mbs, gbs, steps in phases:
        for _ in range(steps):
            ids = step_ids(consumed, dp, mbs, gbs)
            assert len(ids) == len(set(ids)) == gbs
            # The same step under the simplest strategy (one rank, one sample per micro-batch).
            assert set(ids) == set(step_ids(consumed, 1, 1, gbs))
            seen.extend(ids)
            consumed += gbs
    assert sorted(seen) == list(range(consumed))
