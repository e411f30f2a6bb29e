import itertools

import numpy as np
import pytest

from cona.config import ModelConfig
from cona.errors import PlanError
from cona.planner.perf_model import predict, valid_mask
from cona.planner.space import SpaceOptions, divisors, enumerate_strategies, filter_by_memory
from cona.planner.systems import load_system

TINY = ModelConfig(layers=8, hidden=96, heads=6, seq=64, vocab_size=190, make_vocab_size_divisible_by=96)
ONLY_LAYOUT = SpaceOptions(
    zero_stages=(1,), recompute=("none",), sequence_parallel=(False,), interleave=False
)


def as_set(strategies):
    return {strategies[i] for i in range(len(strategies))}


def brute_force_layouts(model, n_gpus, gbs, gpus_per_node):
    """The rules written out as plain loops, to check the vectorised enumeration against."""
    found = set()
    for tp, pp, mbs in itertools.product(range(1, n_gpus + 1), range(1, n_gpus + 1), range(1, gbs + 1)):
        if n_gpus % (tp * pp):
            continue
        dp = n_gpus // (tp * pp)
        if model.heads % tp or model.ffn_size % tp or model.padded_vocab_size % tp or gpus_per_node % tp:
            continue
        if model.layers % pp or gbs % (mbs * dp) or gbs // (mbs * dp) < pp:
            continue
        found.add((dp, tp, pp, mbs))
    return found


@pytest.mark.parametrize(
    ("n_gpus", "gbs", "per_node"), [(1, 4, 1), (4, 8, 4), (6, 12, 2), (12, 48, 4), (8, 6, 8)]
)
def test_layouts_match_brute_force(n_gpus, gbs, per_node):
    strategies = enumerate_strategies(TINY, n_gpus, gbs, gpus_per_node=per_node, options=ONLY_LAYOUT)
    got = {(s.dp, s.tp, s.pp, s.mbs) for s in as_set(strategies)}
    assert got == brute_force_layouts(TINY, n_gpus, gbs, per_node)
    assert len(got) == len(strategies)  # no duplicates
    assert np.all(strategies.dp * strategies.tp * strategies.pp == n_gpus)
    assert np.all(strategies.gbs == gbs)


def test_hand_counted_case():
    # 4 GPUs, gbs 8, heads 6 -> tp in {1, 2}; layers 8 -> pp in {1, 2, 4}.
    # (dp4,tp1,pp1): mbs 1, 2; (dp2,tp2,pp1): mbs 1, 2, 4; (dp2,tp1,pp2): mbs 1, 2 (mbs 4 leaves 1 < 2
    # micro-batches); (dp1,tp2,pp2): mbs 1, 2, 4; (dp1,tp1,pp4): mbs 1, 2.
    strategies = enumerate_strategies(TINY, 4, 8, gpus_per_node=4, options=ONLY_LAYOUT)
    assert len(strategies) == 2 + 3 + 2 + 3 + 2


def test_tp_stays_within_a_node_unless_allowed():
    within = enumerate_strategies(TINY, 12, 48, gpus_per_node=2, options=ONLY_LAYOUT)
    assert set(within.tp.tolist()) == {1, 2}
    across = SpaceOptions(
        zero_stages=(1,),
        recompute=("none",),
        sequence_parallel=(False,),
        interleave=False,
        allow_cross_node_tp=True,
    )
    spanning = enumerate_strategies(TINY, 12, 48, gpus_per_node=2, options=across)
    assert set(spanning.tp.tolist()) == {1, 2, 3, 6}


def test_sequence_parallel_only_with_tp():
    options = SpaceOptions(zero_stages=(1,), recompute=("none",), interleave=False)
    strategies = enumerate_strategies(TINY, 4, 8, gpus_per_node=4, options=options)
    assert np.all(strategies.tp[strategies.sequence_parallel] > 1)
    with_tp = int(np.sum(strategies.tp > 1))
    assert int(np.sum(strategies.sequence_parallel)) == with_tp // 2


def test_zero_stages_are_not_repeated_without_data_parallelism():
    options = SpaceOptions(
        zero_stages=(0, 1, 2, 3), recompute=("none",), sequence_parallel=(False,), interleave=False
    )
    strategies = enumerate_strategies(TINY, 4, 8, gpus_per_node=4, options=options)
    assert set(strategies.zero_stage[strategies.dp == 1].tolist()) == {0}
    assert set(strategies.zero_stage[strategies.dp > 1].tolist()) == {0, 1, 2, 3}
    assert len(strategies) == 4 * (2 + 3 + 2) + 3 + 2


def test_interleaving_rules():
    options = SpaceOptions(zero_stages=(1,), recompute=("none",), sequence_parallel=(False,))
    strategies = enumerate_strategies(TINY, 4, 16, gpus_per_node=4, options=options)
    interleaved = strategies.select(strategies.virtual_stages > 1)
    assert len(interleaved) > 0
    assert np.all(interleaved.pp > 1)
    assert np.all((TINY.layers // interleaved.pp) % interleaved.virtual_stages == 0)
    micro_batches = interleaved.gbs // (interleaved.mbs * interleaved.dp)
    assert np.all(micro_batches % interleaved.pp == 0)
    assert np.all(interleaved.pipeline_schedule == 2)
    assert np.all(strategies.pipeline_schedule[strategies.virtual_stages == 1] == 0)
    # pp 2 -> 4 layers per stage -> v in {2, 4}; pp 4 -> 2 layers per stage -> v = 2.
    assert set(zip(interleaved.pp.tolist(), interleaved.virtual_stages.tolist(), strict=True)) == {
        (2, 2),
        (2, 4),
        (4, 2),
    }


def test_option_product_sizes():
    strategies = enumerate_strategies(TINY, 1, 4, gpus_per_node=1, options=SpaceOptions(interleave=False))
    # dp = tp = pp = 1: mbs in {1, 2, 4}, one zero stage, three recompute modes, no sequence parallelism.
    assert len(strategies) == 3 * 3


def test_max_mbs_and_virtual_stage_bounds():
    options = SpaceOptions(
        zero_stages=(1,), recompute=("none",), sequence_parallel=(False,), max_mbs=2, max_virtual_stages=2
    )
    strategies = enumerate_strategies(TINY, 4, 16, gpus_per_node=4, options=options)
    assert strategies.mbs.max() == 2
    assert strategies.virtual_stages.max() == 2


def test_divisors():
    assert divisors(12).tolist() == [1, 2, 3, 4, 6, 12]
    assert divisors(1).tolist() == [1]


@pytest.mark.parametrize(
    ("n_gpus", "gbs", "message"),
    # 5 GPUs: 5 divides neither the 6 heads nor the 8 layers, so dp = 5, which divides neither 3 nor 12.
    [
        (0, 8, "--gpus"),
        (4, 0, "--gbs"),
        (5, 3, "no valid strategy for 5 GPUs at gbs 3"),
        (5, 12, "no valid strategy for 5 GPUs at gbs 12"),
    ],
)
def test_bad_inputs_are_one_line_errors(n_gpus, gbs, message):
    with pytest.raises(PlanError, match=message) as error:
        enumerate_strategies(TINY, n_gpus, gbs, gpus_per_node=8)
    assert "\n" not in str(error.value)


def test_bad_options_are_refused():
    with pytest.raises(PlanError, match="zero stages"):
        SpaceOptions(zero_stages=(4,))
    with pytest.raises(PlanError, match="recompute"):
        SpaceOptions(recompute=("some",))


GPT_175B = ModelConfig(layers=96, hidden=12288, heads=96, seq=2048, vocab_size=50257)


@pytest.mark.parametrize(
    ("model", "n_gpus", "gbs"), [(TINY, 12, 48), (GPT_175B, 64, 512), (GPT_175B, 512, 4096)]
)
def test_every_strategy_is_valid_for_the_performance_model(model, n_gpus, gbs):
    strategies = enumerate_strategies(model, n_gpus, gbs, gpus_per_node=8)
    assert valid_mask(model, strategies).all()


def test_filter_by_memory_keeps_exactly_what_fits():
    a100 = load_system("a100_80g")
    strategies = enumerate_strategies(GPT_175B, 64, 512, gpus_per_node=a100.gpus_per_node)
    fitting = filter_by_memory(GPT_175B, strategies, a100)
    expected = int((~predict(GPT_175B, strategies, a100).oom).sum())
    assert 0 < len(fitting) == expected < len(strategies)
    assert not predict(GPT_175B, fitting, a100).oom.any()


def test_tp_must_divide_the_key_value_heads_too():
    # 8 heads but 2 key/value heads: tp 4 and 8 divide the heads, yet a rank must hold whole key/value heads.
    gqa = ModelConfig(layers=8, hidden=128, heads=8, kv_heads=2, seq=64, vocab_size=256)
    strategies = enumerate_strategies(gqa, 8, 16, gpus_per_node=8, options=ONLY_LAYOUT)
    assert set(strategies.tp.tolist()) == {1, 2}
    assert valid_mask(gqa, strategies).all()
