"""The one layout rule set: its scalar form, its vectorised form, the engine's check and the planner's mask
accept exactly the layouts the engine runs, written out below as plain Python from the engine's and
torch's own conditions."""

from __future__ import annotations

import itertools

from cona.config import ModelConfig, TrainingConfig
from cona.engine.parallel_dims import validate_layout
from cona.engine.pipeline import stage_layer_ids
from cona.errors import LayoutError
from cona.layout_rules import LayoutSizes, layout_failures, layout_mask
from cona.planner.perf_model import invalid_reasons, valid_mask
from cona.strategy import Strategy, StrategyArray

# Grouped-query attention and sizes that 2, 3 and 4 divide differently, so every tp rule can fail alone.
MODEL = ModelConfig(
    layers=6,
    hidden=96,
    heads=6,
    kv_heads=3,
    seq=30,
    vocab_size=250,
    make_vocab_size_divisible_by=2,
    ffn_hidden=192,
)


def engine_runs(model: ModelConfig, s: Strategy, world_size: int | None) -> bool:
    """What the engine can train, from the code that would fail otherwise."""
    if min(s.dp, s.tp, s.pp, s.mbs, s.gbs, s.virtual_stages) < 1 or s.zero_stage not in (0, 1, 2, 3):
        return False
    if world_size is not None and s.dp * s.tp * s.pp != world_size:
        return False
    # parallelize.py gives each tp rank whole heads, whole key/value heads, FFN columns and vocabulary rows.
    sharded = (model.heads, model.kv_heads, model.ffn_size, model.padded_vocab_size)
    if any(size % s.tp for size in sharded) or (s.sequence_parallel and model.seq % s.tp):
        return False
    if s.gbs % (s.mbs * s.dp):
        return False
    if s.pp == 1:  # no pipeline: the schedule settings are not used
        return True
    if s.virtual_stages > 1 and s.pipeline_schedule != "interleaved_1f1b":
        return False  # build_schedule gives several local stages only to the interleaved schedule
    if not all(stage_layer_ids(model.layers, s.pp * s.virtual_stages)):
        return False  # a stage without a block
    micro = s.micro_batches
    if s.pipeline_schedule == "1f1b":
        return micro >= s.pp  # torch's Schedule1F1B: n_microbatches >= the number of stages
    if s.pipeline_schedule == "interleaved_1f1b":
        # torch's ScheduleInterleaved1F1B: a multiple of max(1, n // pp) rounds; the engine also asks for
        # at least pp micro-batches, as for 1F1B.
        return micro >= s.pp and micro % max(1, micro // s.pp) == 0
    return True  # GPipe: any number of micro-batches


def grid() -> list[Strategy]:
    return [
        Strategy(
            dp=dp,
            tp=tp,
            pp=pp,
            mbs=mbs,
            gbs=gbs,
            zero_stage=zero,
            sequence_parallel=sp,
            virtual_stages=v,
            pipeline_schedule=schedule,
        )
        for dp, tp, pp, mbs, gbs in itertools.product(
            (0, 1, 2), (1, 2, 3, 4), (1, 2, 3, 4, 7), (1, 2), (2, 3, 4, 5, 6, 8, 12)
        )
        for zero, sp in ((1, False), (4, False), (1, True))
        for v, schedule in (
            (1, "1f1b"),
            (1, "gpipe"),
            (2, "1f1b"),
            (2, "interleaved_1f1b"),
            (3, "interleaved_1f1b"),
        )
    ]


def engine_accepts(s: Strategy, world_size: int | None) -> bool:
    try:
        validate_layout(MODEL, TrainingConfig(), s, world_size=world_size)
    except LayoutError:
        return False
    return True


def test_scalar_vectorised_engine_and_planner_agree_with_what_the_engine_runs() -> None:
    sizes = LayoutSizes.of_config(MODEL)
    strategies = grid()
    array = StrategyArray.from_strategies(strategies)
    for world_size in (None, 4):
        truth = [engine_runs(MODEL, s, world_size) for s in strategies]
        scalar = [not layout_failures(sizes, s, world_size) for s in strategies]
        engine = [engine_accepts(s, world_size) for s in strategies]
        assert scalar == truth
        assert layout_mask(sizes, array, world_size).tolist() == truth
        assert engine == truth
        assert 0 < sum(truth) < len(truth)
    planner = valid_mask(MODEL, array)
    assert planner.tolist() == [engine_runs(MODEL, s, None) for s in strategies]
    assert planner.tolist() == [not invalid_reasons(MODEL, s) for s in strategies]


def strategy(**overrides) -> Strategy:
    return Strategy(**({"dp": 1, "tp": 1, "pp": 1, "mbs": 1, "gbs": 4} | overrides))


def test_the_layouts_the_planner_used_to_judge_differently() -> None:
    sizes = LayoutSizes.of_config(MODEL)
    runs = [
        strategy(pp=4),  # 6 layers over 4 stages (1, 2, 2, 1): the planner wanted pp to divide the layers
        strategy(virtual_stages=2),  # no pipeline, so no schedule: the planner refused virtual stages here
        # 5 micro-batches over pp=3 are one round of interleaved 1F1B: the planner wanted 5 % pp == 0
        strategy(pp=3, gbs=5, virtual_stages=2, pipeline_schedule="interleaved_1f1b"),
    ]
    for layout in runs:
        assert layout_failures(sizes, layout) == []
    assert layout_mask(sizes, StrategyArray.from_strategies(runs)).all()
    # torch's 1F1B refuses fewer micro-batches than stages, which the planner let through
    assert layout_failures(sizes, strategy(pp=2, gbs=1)) == [
        "1f1b needs at least pp=2 micro-batches per step, got gbs/(mbs*dp)=1"
    ]
