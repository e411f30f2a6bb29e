"""Masked-LM samples (BERT): ``[CLS] tokens [SEP]`` with 15% of the ordinary tokens chosen for prediction.

A sample's masking is a pure function of (``training.seed``, split, global sample id): the generator is
seeded from those alone, so a sample is masked the same way under every dp/mbs/gbs/tp/pp layout, after a
switch and after a restart, whatever micro-batch it lands in. The sample order itself comes from
:mod:`cona.data.gpt_dataset` (no sample skipped or repeated across switches).

The rule is BERT's (Devlin et al. 2019, and Google's ``create_pretraining_data.py``): choose
``max(1, round(0.15 * n))`` of the ``n`` positions that hold an ordinary token (never [CLS], [SEP], [MASK],
[PAD] or [UNK]); each chosen position independently becomes [MASK] with probability 0.8, a random
ordinary token with probability 0.1 (it may draw the original), and keeps its token with probability 0.1.
Targets are the original ids at the chosen positions and ``IGNORE_INDEX`` (-100, as ``F.cross_entropy``
ignores it) everywhere else, so the loss is the mean over the chosen positions only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from cona.data.tokenizer import WordPieceTokenizer

IGNORE_INDEX = -100
"""Target of a position without loss (the default ``ignore_index`` of ``F.cross_entropy``)."""
SPECIALS_PER_SAMPLE = 2
"""[CLS] and [SEP] around the ``seq - 2`` tokens taken from the packed stream."""
MASKING_STREAM = 0x4D4C4D  # "MLM": keeps these generators apart from every other use of (seed, ...)


@dataclass(frozen=True, kw_only=True)
class MaskingRule:
    """Special ids and probabilities of BERT's masking; build it with :func:`masking_rule`."""

    cls_id: int
    sep_id: int
    mask_id: int
    special_ids: tuple[int, ...]
    ordinary_ids: np.ndarray = field(repr=False, compare=False)
    """Ids a random replacement draws from: the vocabulary without the special tokens."""
    seed: int
    probability: float = 0.15
    mask_share: float = 0.8
    random_share: float = 0.1


def masking_rule(tokenizer: WordPieceTokenizer, *, seed: int) -> MaskingRule:
    specials = tokenizer.special_ids
    ordinary = np.setdiff1d(np.arange(tokenizer.vocab_size, dtype=np.int64), np.asarray(specials))
    return MaskingRule(
        cls_id=tokenizer.cls_id,
        sep_id=tokenizer.sep_id,
        mask_id=tokenizer.mask_id,
        special_ids=specials,
        ordinary_ids=ordinary,
        seed=seed,
    )


def sample_generator(rule: MaskingRule, split_index: int, sample_id: int) -> np.random.Generator:
    """The generator of one sample's masking: seeded by (seed, split, sample id) and nothing else."""
    return np.random.default_rng(np.random.SeedSequence([MASKING_STREAM, rule.seed, split_index, sample_id]))


def chosen_positions(tokens: np.ndarray, rule: MaskingRule, rng: np.random.Generator) -> np.ndarray:
    """Sorted positions of ``tokens`` chosen for prediction: 15% (at least one) of the ordinary tokens."""
    candidates = np.flatnonzero(~np.isin(tokens, rule.special_ids))
    if len(candidates) == 0:
        return candidates
    count = max(1, int(np.floor(rule.probability * len(candidates) + 0.5)))
    return np.sort(rng.choice(candidates, size=count, replace=False))


def mask_sample(
    content: np.ndarray, rule: MaskingRule, *, split_index: int, sample_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets), int64 ``[len(content) + 2]``: ``[CLS] content [SEP]`` masked by BERT's rule."""
    rng = sample_generator(rule, split_index, sample_id)
    tokens = np.concatenate([[rule.cls_id], content, [rule.sep_id]]).astype(np.int64)
    positions = chosen_positions(tokens, rule, rng)
    targets = np.full_like(tokens, IGNORE_INDEX)
    targets[positions] = tokens[positions]
    draw = rng.random(len(positions))
    to_mask = positions[draw < rule.mask_share]
    to_random = positions[(draw >= rule.mask_share) & (draw < rule.mask_share + rule.random_share)]
    inputs = tokens.copy()
    inputs[to_mask] = rule.mask_id
    inputs[to_random] = rule.ordinary_ids[rng.integers(len(rule.ordinary_ids), size=len(to_random))]
    return inputs, targets
