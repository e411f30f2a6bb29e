"""Masked-LM samples: BERT's 15% / 80-10-10 rule, specials never chosen, and masking as a pure function of
(seed, split, sample id), so every layout and every switch sees the same masks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from cona.config import parse_config
from cona.data.gpt_dataset import MaskedLMDataset, build_datasets, collate, micro_batch_sample_ids
from cona.data.indexed import IndexedDatasetWriter
from cona.data.masking import IGNORE_INDEX, MaskingRule, mask_sample
from cona.errors import DataError

PAD, UNK, CLS, SEP, MASK = range(5)
VOCAB = 1000
SEQ = 32


def make_rule(seed: int = 11) -> MaskingRule:
    specials = (PAD, UNK, CLS, SEP, MASK)
    ordinary = np.arange(len(specials), VOCAB, dtype=np.int64)
    return MaskingRule(
        cls_id=CLS, sep_id=SEP, mask_id=MASK, special_ids=specials, ordinary_ids=ordinary, seed=seed
    )


def content_of(sample_id: int, length: int = SEQ - 2) -> np.ndarray:
    return np.random.default_rng(sample_id).integers(5, VOCAB, size=length)


def test_rule_proportions_over_many_samples() -> None:
    rule = make_rule()
    chosen = masked = randomised = kept = 0
    samples, length = 2000, 126
    for sample_id in range(samples):
        content = content_of(sample_id, length)
        inputs, targets = mask_sample(content, rule, split_index=0, sample_id=sample_id)
        at = targets != IGNORE_INDEX
        assert at.sum() == round(0.15 * length)  # 19 of 126: BERT's count, exactly
        assert np.array_equal(targets[at], np.concatenate([[CLS], content, [SEP]])[at])
        chosen += int(at.sum())
        masked += int((inputs[at] == MASK).sum())
        unchanged = inputs[at] == targets[at]
        kept += int(unchanged.sum())
        randomised += int((~unchanged & (inputs[at] != MASK)).sum())
        assert not np.isin(inputs[at], (PAD, UNK, CLS, SEP)).any()  # a random token is never special
    # Binomial counts: 5 standard deviations (p = 0.8 / 0.1; a random draw equal to the original counts
    # as kept, which moves 0.1 * 1/995 of the mass).
    for count, p in ((masked, 0.8), (randomised, 0.1 * (1 - 1 / 995)), (kept, 0.1 * (1 + 1 / 995))):
        assert abs(count - p * chosen) < 5 * np.sqrt(chosen * p * (1 - p)), (count, p, chosen)


def test_specials_are_never_chosen_and_frame_the_sample() -> None:
    rule = make_rule()
    content = content_of(0)
    content[[3, 10, 11, 20]] = [SEP, UNK, PAD, MASK]  # document separator, unknown word, ...
    for sample_id in range(200):
        inputs, targets = mask_sample(content, rule, split_index=0, sample_id=sample_id)
        assert inputs.shape == targets.shape == (SEQ,)
        assert (inputs[0], inputs[-1]) == (CLS, SEP)
        specials = np.isin(np.concatenate([[CLS], content, [SEP]]), rule.special_ids)
        assert (targets[specials] == IGNORE_INDEX).all()
        assert (inputs[specials] == np.concatenate([[CLS], content, [SEP]])[specials]).all()
        assert (targets != IGNORE_INDEX).sum() == round(0.15 * (SEQ - 2 - 4))
    only_specials = np.full(SEQ - 2, UNK)
    inputs, targets = mask_sample(only_specials, rule, split_index=0, sample_id=0)
    assert (targets == IGNORE_INDEX).all() and (inputs[1:-1] == UNK).all()


def test_masking_is_a_function_of_seed_split_and_sample_id() -> None:
    rule = make_rule()
    content = content_of(5)
    first = mask_sample(content, rule, split_index=0, sample_id=5)
    for _ in range(3):  # whatever was drawn in between
        mask_sample(content_of(9), rule, split_index=0, sample_id=9)
    again = mask_sample(content, rule, split_index=0, sample_id=5)
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    for other in (
        mask_sample(content, rule, split_index=0, sample_id=6),
        mask_sample(content, rule, split_index=1, sample_id=5),
        mask_sample(content, make_rule(seed=12), split_index=0, sample_id=5),
    ):
        assert not np.array_equal(first[1], other[1])


def write_vocab(path: Path) -> Path:
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *(f"w{i}" for i in range(VOCAB - 5))]
    path.write_text("\n".join(tokens) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def bert_config(tmp_path: Path):
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(tmp_path / "docs", np.uint16) as writer:
        for _ in range(40):
            doc = rng.integers(5, VOCAB, size=int(rng.integers(5, 60)))
            writer.add_document(np.append(doc, SEP))  # --append-eod's [SEP]
    raw = {
        "model": {"family": "bert", "layers": 1, "hidden": 8, "heads": 1, "seq": SEQ},
        "training": {
            "data_prefix": str(tmp_path / "docs"),
            "vocab_file": str(write_vocab(tmp_path / "vocab.txt")),
            "tokenizer_type": "BertWordPieceLowerCase",
            "split": "80,15,5",
            "seed": 7,
            "data_cache_path": str(tmp_path / "cache"),
        },
    }
    return parse_config(raw, source=tmp_path / ".conaconfig")


def test_bert_datasets_give_the_same_rows_under_every_layout(bert_config) -> None:
    splits = build_datasets(bert_config)
    assert isinstance(splits.train, MaskedLMDataset) and isinstance(splits.valid, MaskedLMDataset)
    gbs, steps = 8, 3
    rows: dict[tuple[int, int], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for dp, mbs in ((1, 8), (4, 1), (2, 2), (1, 1)):
        by_id = {}
        for step in range(steps):
            for rank in range(dp):
                for ids in micro_batch_sample_ids(step * gbs, gbs, mbs, dp, rank):
                    inputs, targets = collate(splits.train, ids)
                    assert inputs.shape == targets.shape == (mbs, SEQ) and inputs.dtype == torch.int64
                    by_id.update({int(i): (inputs[k], targets[k]) for k, i in enumerate(ids)})
        rows[(dp, mbs)] = by_id
    reference = rows[(1, 8)]
    assert sorted(reference) == list(range(gbs * steps))
    for by_id in rows.values():
        assert by_id.keys() == reference.keys()
        for sample_id, (inputs, targets) in by_id.items():
            assert torch.equal(inputs, reference[sample_id][0]) and torch.equal(
                targets, reference[sample_id][1]
            )
    inputs, targets = collate(splits.train, np.arange(gbs * steps))
    assert (inputs[:, 0] == CLS).all() and (inputs[:, -1] == SEP).all()
    assert ((targets != IGNORE_INDEX).sum(1) >= 1).all()


def test_bert_samples_tile_the_stream_without_overlap(bert_config) -> None:
    train = build_datasets(bert_config).train
    index = train.epoch_index(0)
    sizes = train.indexed.sizes[index.doc_order].astype(np.int64)
    doc_begin = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    starts = doc_begin[index.sample_starts[:, 0]] + index.sample_starts[:, 1]  # offsets in the packed stream
    assert np.array_equal(np.diff(starts), np.full(len(starts) - 1, SEQ - 2))


def test_bert_data_needs_the_wordpiece_vocab(bert_config, tmp_path: Path) -> None:
    no_vocab = parse_config(
        {
            "model": {
                "family": "bert",
                "layers": 1,
                "hidden": 8,
                "heads": 1,
                "seq": SEQ,
                "vocab_size": VOCAB,
            },
            "training": {
                "data_prefix": bert_config.training.data.data_prefix,
                "tokenizer_type": "BertWordPieceLowerCase",
            },
        },
        source=tmp_path / ".conaconfig",
    )
    with pytest.raises(DataError, match="training.vocab_file"):
        build_datasets(no_vocab)
