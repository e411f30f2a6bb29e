"""Fixtures the engine tests share."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from tests.helpers.torchrun_util import free_port


@pytest.fixture(scope="module")
def one_process_group():
    """A 1-process gloo group in this pytest process (the engine builds its mesh on it)."""
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    assert dist.get_world_size() == 1
    yield
    if created:
        dist.destroy_process_group()
