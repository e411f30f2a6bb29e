"""validate_layout refuses every impossible layout with a message saying why; stage splits balance layers."""

from __future__ import annotations

import pytest

from cona.config import ModelConfig, TrainingConfig
from cona.engine.parallel_dims import validate_layout
from cona.engine.pipeline import num_stages, stage_ids_of_rank, stage_layer_ids
from cona.errors import LayoutError
from cona.strategy import Strategy

MODEL = ModelConfig(layers=4, hidden=64, heads=4, seq=32, vocab_size=256, ffn_hidden=192)
TRAINING = TrainingConfig()


def strategy(**overrides) -> Strategy:
    fields = {"dp": 1, "tp": 1, "pp": 1, "mbs": 2, "gbs": 8} | overrides
    return Strategy(**fields)


@pytest.mark.parametrize(
    ("overrides", "world_size", "message"),
    [
        ({"tp": 8}, None, "tp=8 does not divide model.heads=4"),
        ({"dp": 0}, None, "dp must be positive, got 0"),
        ({"dp": 2}, 4, "dp*tp*pp = 2 processes, but 4 were launched"),
        ({"zero_stage": 4}, None, "zero_stage 4 is not one of 0, 1, 2, 3"),
        ({"gbs": 6, "mbs": 4}, None, "gbs=6 is not a multiple of mbs*dp=4"),
        ({"gbs": 8, "mbs": 2, "dp": 3}, None, "gbs=8 is not a multiple of mbs*dp=6"),
        ({"pp": 8, "gbs": 16, "mbs": 1}, None, "model.layers=4 is fewer than pp*virtual_stages=8"),
        ({"pp": 4, "gbs": 4, "mbs": 2}, None, "1f1b needs at least pp=4 micro-batches per step, got"),
        (
            {"pp": 2, "virtual_stages": 2},
            None,
            "virtual_stages=2 needs the interleaved_1f1b schedule, not 1f1b",
        ),
        (
            {"pp": 2, "virtual_stages": 4, "pipeline_schedule": "interleaved_1f1b", "gbs": 16},
            None,
            "model.layers=4 is fewer than pp*virtual_stages=8",
        ),
        (
            {"pp": 2, "virtual_stages": 2, "pipeline_schedule": "interleaved_1f1b", "gbs": 10},
            None,
            "interleaved_1f1b needs the 5 micro-batches to be a multiple of 2 rounds",
        ),
    ],
)
def test_impossible_layouts_are_refused_with_the_reason(overrides, world_size, message) -> None:
    with pytest.raises(LayoutError, match=message.replace("*", r"\*")):
        validate_layout(MODEL, TRAINING, strategy(**overrides), world_size=world_size)


def test_tensor_parallel_must_divide_ffn_and_padded_vocab_and_sequence() -> None:
    odd_ffn = ModelConfig(layers=4, hidden=64, heads=4, seq=32, vocab_size=256, ffn_hidden=190)
    with pytest.raises(
        LayoutError, match=r"tp=4 does not divide the feed-forward size 190 \(model.ffn_hidden\)"
    ):
        validate_layout(odd_ffn, TRAINING, strategy(tp=4))
    small_pad = ModelConfig(
        layers=4, hidden=64, heads=4, seq=32, vocab_size=250, make_vocab_size_divisible_by=2
    )
    with pytest.raises(LayoutError, match="tp=4 does not divide the padded vocabulary 250"):
        validate_layout(small_pad, TRAINING, strategy(tp=4))
    odd_seq = ModelConfig(layers=4, hidden=64, heads=4, seq=30, vocab_size=256)
    with pytest.raises(LayoutError, match="sequence parallel needs tp=4 to divide model.seq=30"):
        validate_layout(odd_seq, TRAINING, strategy(tp=4, sequence_parallel=True))
    validate_layout(odd_seq, TRAINING, strategy(tp=4))  # without sequence parallel the length is free


def test_message_names_the_strategy() -> None:
    with pytest.raises(LayoutError, match=r"^strategy dp1/tp8/pp1 mbs2 gbs8: "):
        validate_layout(MODEL, TRAINING, strategy(tp=8))


@pytest.mark.parametrize(
    ("overrides", "broken"),
    [
        ({"dp": 2, "tp": 2, "pp": 2}, {"gbs": 4}),  # gbs 4: one micro-batch per dp rank, fewer than pp
        ({"pp": 2, "gbs": 4}, {"gbs": 2}),
        ({"pp": 2, "pipeline_schedule": "gpipe", "gbs": 2}, {"pipeline_schedule": "1f1b"}),
        (
            {"pp": 2, "virtual_stages": 2, "pipeline_schedule": "interleaved_1f1b"},
            {"pipeline_schedule": "1f1b"},
        ),
        ({"tp": 4, "sequence_parallel": True, "zero_stage": 3}, {"tp": 8}),
        (
            {"pp": 1, "virtual_stages": 2, "pipeline_schedule": "interleaved_1f1b", "gbs": 2},
            {"pp": 4},
        ),  # no pipeline
        ({"pp": 1, "gbs": 2, "mbs": 2}, {"pp": 2}),  # 1f1b's micro-batch rule only applies to a pipeline
    ],
)
def test_possible_layouts_pass_and_their_neighbour_across_the_rule_does_not(overrides, broken) -> None:
    """Each possible layout sits at the edge of a rule: one field more (``broken``) crosses it."""
    layout = strategy(**overrides)
    validate_layout(MODEL, TRAINING, layout, world_size=layout.world_size)
    crossed = strategy(**(overrides | broken))
    with pytest.raises(LayoutError):
        validate_layout(MODEL, TRAINING, crossed, world_size=crossed.world_size)


def test_gpipe_accepts_fewer_micro_batches_than_stages() -> None:
    validate_layout(MODEL, TRAINING, strategy(pp=4, gbs=2, pipeline_schedule="gpipe"))


def test_stage_split_is_balanced_and_keeps_order() -> None:
    assert stage_layer_ids(4, 2) == [[0, 1], [2, 3]]
    assert stage_layer_ids(5, 2) == [[0, 1, 2], [3, 4]]  # no middle stage: the first takes the extra
    assert stage_layer_ids(7, 3) == [[0, 1], [2, 3, 4], [5, 6]]  # the middle stage first
    assert stage_layer_ids(10, 4) == [[0, 1], [2, 3, 4], [5, 6, 7], [8, 9]]
    for layers, stages in [(4, 4), (13, 4), (24, 8), (6, 1)]:
        split = stage_layer_ids(layers, stages)
        assert [i for ids in split for i in ids] == list(range(layers))
        assert max(map(len, split)) - min(map(len, split)) <= 1


def test_interleaved_ranks_hold_every_pp_th_stage() -> None:
    layout = strategy(pp=2, virtual_stages=3, pipeline_schedule="interleaved_1f1b")
    assert stage_ids_of_rank(layout, 0) == [0, 2, 4]
    assert stage_ids_of_rank(layout, 1) == [1, 3, 5]
    no_pipeline = strategy(pp=1, virtual_stages=3, pipeline_schedule="interleaved_1f1b")
    assert stage_ids_of_rank(no_pipeline, 0) == [0] and num_stages(no_pipeline) == 1
