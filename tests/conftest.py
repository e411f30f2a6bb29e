"""Settings and the fixture every test process shares."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

# One intra-op thread in the pytest process (read by torch when it is first imported, which is after this
# file): the tests' models are tiny, where a second thread gains nothing, and on a machine whose cores other
# processes keep busy two threads per op spin against each other (a tiny GPT's step took 35x longer).
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def tiny_config_file(tmp_path: Path) -> Callable[..., Path]:
    """Writes the tiny ``.conaconfig`` (:func:`tests.helpers.tiny.write_tiny_config`): called as
    ``tiny_config_file(directory=tmp_path, *, data=None, model=None, training=None, documents=300, seed=0)``
    it returns the file's path."""
    from tests.helpers.tiny import write_tiny_config  # imports torch: after OMP_NUM_THREADS is set

    def write(directory: Path | None = None, **options) -> Path:
        return write_tiny_config(tmp_path if directory is None else directory, **options)

    return write
