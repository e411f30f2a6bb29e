"""bench/noise_scale_variants.py: B_simple of raw and preconditioned gradients, on planted gradients."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cona.data.indexed import IndexedDatasetWriter

K, M = 4000, 4
"""Micro-batch gradients per estimate, and samples per micro-batch gradient."""


@pytest.fixture(scope="module")
def variants(import_bench):
    return import_bench("noise_scale_variants")


def planted(mean: list[float], per_sample_var: list[float], seed: int = 0) -> list[list[torch.Tensor]]:
    """``K`` micro-batch gradients of ``M`` samples, as two parameter tensors of one element each: the true
    gradient ``mean`` plus noise of variance ``per_sample_var / M`` per element."""
    generator = torch.Generator().manual_seed(seed)
    grads = []
    for _ in range(K):
        noise = torch.randn(len(mean), generator=generator, dtype=torch.float64)
        values = torch.tensor(mean, dtype=torch.float64) + noise * torch.tensor(per_sample_var).div(M).sqrt()
        grads.append([values[:1], values[1:]])
    return grads


def test_raw_b_simple_is_the_planted_trace_over_the_squared_gradient(variants) -> None:
    grads = planted([1.0, 2.0], [12.0, 8.0])  # tr(Sigma) 20 over |G|^2 5
    assert variants.b_simple(grads, [1.0, 1.0], M) == pytest.approx(4.0, rel=0.1)


def test_preconditioning_weighs_the_elements_and_a_common_scale_changes_nothing(variants) -> None:
    # A large, quiet element and a small, noisy one: dividing the second by 0.1 (as Adam does for an
    # element whose second moment is small) makes its noise count: tr(P Sigma P) / |P G|^2 with P = (1, 10).
    grads = planted([1.0, 0.1], [1.0, 0.5])
    raw = variants.b_simple(grads, [1.0, 1.0], M)
    preconditioned = variants.b_simple(grads, [1.0, 10.0], M)
    assert raw == pytest.approx(1.5 / 1.01, rel=0.1)
    assert preconditioned == pytest.approx((1.0 + 50.0) / 2.0, rel=0.1)
    assert variants.b_simple(grads, [3.0, 30.0], M) == pytest.approx(preconditioned, rel=1e-9)


def test_windows_come_from_across_the_corpus_in_a_seeded_order_each_once(variants, tmp_path) -> None:
    prefix = tmp_path / "corpus"
    with IndexedDatasetWriter(prefix, np.uint16) as writer:  # token i at stream position i, in 3 documents
        for first, last in ((0, 17), (17, 31), (31, 52)):
            writer.add_document(list(range(first, last)))
    windows = variants.Windows(str(prefix), tokens_needed=40, seq=4, device=torch.device("cpu"))
    drawn = [variants.Windows(str(prefix), 40, 4, torch.device("cpu")).batch(10) for _ in range(2)]
    assert torch.equal(drawn[0][0], drawn[1][0])  # the same seed, the same order
    inputs, targets = windows.batch(6)
    more_inputs, _ = windows.batch(4)
    starts = [int(row[0]) for row in torch.cat([inputs, more_inputs])]
    assert sorted(starts) == list(range(0, 50, 5))  # the 10 whole windows of 52 tokens, each once
    assert starts != sorted(starts)  # not in corpus order
    assert torch.equal(targets, inputs + 1)  # the next token of each window's stream slice
    with pytest.raises(SystemExit, match="corpus"):
        variants.Windows(str(prefix), tokens_needed=60, seq=4, device=torch.device("cpu"))
