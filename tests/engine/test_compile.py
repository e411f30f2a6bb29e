"""Static-shape compiles: the warm-up helper's graphs load from the on-disk cache in the training process,
and an in-place switch of mbs and back compiles each shape once."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tests.helpers.tiny import tiny_config, tiny_engine
from torch._dynamo.utils import counters

from cona.engine.compile_warmup import compile_shapes, warm_strategies
from cona.strategy import Strategy

pytestmark = pytest.mark.slow


def test_warm_strategies_are_one_rank_copies_of_the_other_sizes() -> None:
    stage = Strategy(dp=4, tp=1, pp=1, mbs=2, gbs=16)
    shapes = warm_strategies(stage, (8, 2, 4))
    assert [(s.dp, s.mbs, s.gbs) for s in shapes] == [(1, 4, 4), (1, 8, 8)]


def test_warmed_graphs_load_from_the_cache_and_a_switch_back_compiles_nothing(
    one_process_group, tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "compile-cache"))
    config = tiny_config(model={"seq": 8})
    config = dataclasses.replace(config, training=config.training.replace(compile=True))
    torch._dynamo.reset()
    counters.clear()
    compile_shapes(config, Strategy(dp=1, tp=1, pp=1, mbs=2, gbs=2), (4,), torch.device("cpu"))
    assert counters["inductor"]["fxgraph_cache_miss"] > 0  # the helper compiled (mbs 4 and its pieces of 2)

    torch._dynamo.reset()  # a new process: nothing compiled in memory, the disk cache stays
    engine = tiny_engine(gbs=2, mbs=2, config=config)
    tokens = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()  # as the data loader gives

    def step(mbs: int) -> None:
        engine.rebatch(Strategy(dp=1, tp=1, pp=1, mbs=mbs, gbs=mbs))
        engine.train_step_pending([(inputs[:mbs], targets[:mbs])], measure_gns=False).result()
        engine.drop_gradients()

    step(2)  # the stage's own size compiles here
    counters.clear()
    for mbs in (4, 2, 4):  # an in-place switch to the warmed size, and back and forth
        step(mbs)
    assert counters["inductor"]["fxgraph_cache_miss"] == 0  # mbs 4 came from the helper's cache
    assert counters["inductor"]["fxgraph_cache_hit"] == 2  # its forward and backward, loaded once
    assert counters["stats"]["unique_graphs"] == 1  # the switches back and forth compiled nothing more
