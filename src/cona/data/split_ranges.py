"""Which documents of a corpus each split (train, valid, test) holds: pure, without torch, so that the runner
can check a dataset against its config before any worker starts (:mod:`cona.data.checks`)."""

from __future__ import annotations

from cona.config.training import split_fractions


def split_document_ranges(num_documents: int, split: str) -> list[tuple[int, int]]:
    """Megatron's ``get_train_valid_test_split_``: contiguous [begin, end) document ranges."""
    bounds = [0]
    for fraction in split_fractions(split):
        bounds.append(bounds[-1] + int(round(fraction * float(num_documents))))
    excess = bounds[-1] - num_documents
    bounds = [bounds[0]] + [bound - excess for bound in bounds[1:]]
    return [(bounds[i], bounds[i + 1]) for i in range(3)]
