"""The iteration-time and memory model: hand-computed values, structure and monotonicity."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cona.config import ModelConfig
from cona.errors import PlanError
from cona.planner import flops
from cona.planner.perf_model import GIB, invalid_reasons, predict, valid_mask
from cona.planner.systems import load_system
from cona.strategy import Strategy, StrategyArray

GPT3_XL = ModelConfig(layers=24, hidden=2048, heads=16, seq=2048, vocab_size=50257)
A100 = load_system("a100_80g")


def one(strategy: Strategy, model: ModelConfig = GPT3_XL, **kwargs) -> dict:
    return predict(model, strategy, A100, **kwargs).row(0)


def test_memory_of_gpt3_xl_with_zero1_by_hand():
    params = flops.parameter_count(GPT3_XL)
    row = one(Strategy(dp=8, tp=1, pp=1, mbs=1, gbs=8, zero_stage=1))
    # fp32 parameters, gradients and Adam m, v sharded over 8 ranks, plus the gathered bf16 parameters.
    assert row["weights_gib"] * GIB == pytest.approx(4 * params / 8 + 2 * params)
    assert row["grads_gib"] * GIB == pytest.approx(4 * params / 8)
    assert row["optimizer_gib"] * GIB == pytest.approx(8 * params / 8)
    # Two micro-batches: FSDP2 accumulates unsharded bf16 gradients until the last one.
    accumulating = one(Strategy(dp=8, tp=1, pp=1, mbs=1, gbs=16, zero_stage=1))
    assert accumulating["grads_gib"] * GIB == pytest.approx(4 * params / 8 + 2 * params)


def test_replicated_memory_is_18_bytes_per_parameter_in_bf16_and_16_in_fp32():
    params = flops.parameter_count(GPT3_XL)
    for dtype, per_param in (("bf16", 18), ("fp32", 16)):
        row = one(Strategy(dp=4, tp=1, pp=1, mbs=1, gbs=4, zero_stage=0), dtype=dtype)
        total = row["weights_gib"] + row["grads_gib"] + row["optimizer_gib"]
        assert total * GIB == pytest.approx(per_param * params)
    # dp = 1 has no data-parallel wrapper: the ZeRO stage makes no difference.
    alone = [one(Strategy(dp=1, tp=1, pp=1, mbs=1, gbs=1, zero_stage=z))["memory_gib"] for z in range(4)]
    assert alone == pytest.approx([alone[0]] * 4)


def test_zero_stages_shard_progressively_and_cost_more_traffic():
    rows = [one(Strategy(dp=8, tp=1, pp=1, mbs=1, gbs=8, zero_stage=z)) for z in range(4)]
    memory = [r["memory_gib"] for r in rows]
    assert memory[0] > memory[1] == memory[2] > memory[3]  # FSDP2: ZeRO 1 and 2 are one mode
    assert rows[3]["dp_comm_exposed_s"] >= rows[1]["dp_comm_exposed_s"] > 0


def test_one_f_one_b_bubble_is_pp_minus_1_over_m_v_of_the_stage_time():
    tiny_vocab = dataclasses.replace(GPT3_XL, vocab_size=128)  # makes the last stage's LM head negligible
    for pp, m, v in ((4, 8, 1), (4, 8, 2), (2, 16, 3), (8, 8, 1)):
        strategy = Strategy(
            dp=1,
            tp=1,
            pp=pp,
            mbs=1,
            gbs=m,
            virtual_stages=v,
            pipeline_schedule="interleaved_1f1b" if v > 1 else "1f1b",
        )
        row = one(strategy, tiny_vocab)
        busy = row["compute_s"] + row["tp_comm_s"]
        assert row["pp_bubble_s"] / busy == pytest.approx((pp - 1) / (m * v), rel=0.02)


def test_gpipe_has_the_1f1b_bubble_but_holds_every_micro_batch():
    base = Strategy(dp=1, tp=1, pp=4, mbs=1, gbs=16)
    one_f = one(base)
    gpipe = one(dataclasses.replace(base, pipeline_schedule="gpipe"))
    assert gpipe["pp_bubble_s"] == pytest.approx(one_f["pp_bubble_s"])
    assert gpipe["activations_gib"] > 3 * one_f["activations_gib"]


def test_terms_vanish_without_their_parallelism():
    row = one(Strategy(dp=1, tp=1, pp=1, mbs=2, gbs=4))
    assert row["tp_comm_s"] == row["pp_bubble_s"] == row["pp_p2p_s"] == row["dp_comm_exposed_s"] == 0.0
    total = sum(row[k] for k in ("compute_s", "optimizer_s"))
    assert row["iteration_time_s"] == pytest.approx(total)
    assert row["tokens_per_s"] == pytest.approx(4 * 2048 / total)


def test_more_model_parallelism_or_recompute_needs_less_memory():
    base = Strategy(dp=1, tp=1, pp=1, mbs=4, gbs=16)
    memory = lambda **change: one(dataclasses.replace(base, **change))["memory_gib"]  # noqa: E731
    assert memory(tp=2) < memory() and memory(tp=4) < memory(tp=2)
    assert memory(pp=2) < memory() and memory(pp=4) < memory(pp=2)
    assert memory(recompute="full") < memory(recompute="selective") <= memory()
    assert memory(tp=4, sequence_parallel=True) < memory(tp=4)
    assert one(base, flash_attention=False)["activations_gib"] > one(base)["activations_gib"]


def test_recompute_costs_time_and_tp_across_nodes_is_slower():
    base = Strategy(dp=1, tp=8, pp=1, mbs=1, gbs=8)
    assert one(dataclasses.replace(base, recompute="full"))["compute_s"] > one(base)["compute_s"]
    two_per_node = load_system("a100_80g_2gpu_node")
    inside = predict(GPT3_XL, dataclasses.replace(base, tp=2), two_per_node).row(0)["tp_comm_s"]
    across = predict(GPT3_XL, dataclasses.replace(base, tp=4), two_per_node).row(0)["tp_comm_s"]
    assert across > inside


def test_vectorised_prediction_equals_one_at_a_time():
    strategies = [
        Strategy(dp=dp, tp=tp, pp=pp, mbs=mbs, gbs=64, zero_stage=zero, recompute=rc, sequence_parallel=sp)
        for dp, tp, pp in ((8, 1, 1), (2, 2, 2), (1, 4, 2), (1, 1, 8))
        for mbs in (1, 2)
        for zero in (0, 3)
        for rc in ("none", "full")
        for sp in (False, tp > 1)
    ]
    strategies.append(
        Strategy(dp=1, tp=2, pp=4, mbs=1, gbs=64, pipeline_schedule="interleaved_1f1b", virtual_stages=3)
    )
    together = predict(GPT3_XL, StrategyArray.from_strategies(strategies), A100)
    for index, strategy in enumerate(strategies):
        alone = predict(GPT3_XL, strategy, A100).row(0)
        assert together.row(index) == pytest.approx(alone)


def test_impossible_strategies_are_refused_in_one_line():
    for strategy, reason in (
        (Strategy(dp=1, tp=3, pp=1, mbs=1, gbs=1), "tp=3 does not divide heads=16"),
        (Strategy(dp=1, tp=1, pp=32, mbs=1, gbs=32), r"layers=24 is fewer than pp\*virtual_stages=32"),
        (Strategy(dp=1, tp=1, pp=4, mbs=1, gbs=2), "1f1b needs at least pp=4 micro-batches"),
        (Strategy(dp=3, tp=1, pp=1, mbs=2, gbs=8), "gbs=8 is not a multiple"),
        (Strategy(dp=1, tp=1, pp=1, mbs=1, gbs=1, zero_stage=4), "zero_stage 4"),
        (Strategy(dp=1, tp=1, pp=2, mbs=1, gbs=2, virtual_stages=2), "needs the interleaved_1f1b schedule"),
    ):
        with pytest.raises(PlanError, match=reason) as info:
            one(strategy)
        assert "\n" not in str(info.value)


def test_oom_flag_uses_capacity_minus_reserved():
    huge = ModelConfig(layers=96, hidden=12288, heads=96, seq=2048, vocab_size=51200)
    prediction = predict(
        huge,
        StrategyArray.from_strategies(
            [
                Strategy(dp=1, tp=1, pp=1, mbs=1, gbs=1),
                Strategy(dp=1, tp=8, pp=16, mbs=1, gbs=16, recompute="full"),
            ]
        ),
        A100,
    )
    assert prediction.oom.tolist() == [True, False]
    assert np.all(prediction.memory_gib[1] + A100.gpu.reserved_gib <= A100.gpu.memory_gib)


def test_valid_mask_agrees_with_the_reasons():
    strategies = [
        Strategy(
            dp=dp,
            tp=tp,
            pp=pp,
            mbs=mbs,
            gbs=gbs,
            zero_stage=z,
            sequence_parallel=sp,
            virtual_stages=v,
            pipeline_schedule=schedule,
        )
        for dp in (1, 3)
        for tp in (1, 3, 4)
        for pp in (1, 2, 5)
        for mbs in (1, 2)
        for gbs in (8, 12)
        for z in (1, 4)
        for sp in (False, True)
        for v, schedule in ((1, "1f1b"), (2, "interleaved_1f1b"), (2, "1f1b"))
    ]
    mask = valid_mask(GPT3_XL, StrategyArray.from_strategies(strategies))
    assert mask.tolist() == [not invalid_reasons(GPT3_XL, s) for s in strategies]
    assert 0 < mask.sum() < len(mask)


def with_intra_bandwidth(system, gbps: float):
    return dataclasses.replace(system, intra_node=dataclasses.replace(system.intra_node, bandwidth_gbps=gbps))


def test_dp_traffic_by_hand_zero0_exposed_zero1_hidden_but_the_last_block():
    params = flops.parameter_count(GPT3_XL)
    for gbps, hidden in ((1e6, True), (1e-3, False)):
        system = with_intra_bandwidth(A100, gbps)
        link = system.intra_node
        bandwidth = gbps * 1e9 * link.efficiency

        def ring(nbytes, hops, link=link, bandwidth=bandwidth):
            return hops * (link.latency_s + nbytes / 8 / bandwidth)

        all_reduce = ring(4 * params, 14)  # fp32 gradients, 2(n-1) hops
        zero0 = predict(GPT3_XL, Strategy(dp=8, tp=1, pp=1, mbs=1, gbs=8, zero_stage=0), system).row(0)
        assert zero0["dp_comm_exposed_s"] == pytest.approx(all_reduce)  # after the backward: nothing overlaps
        gather, reduce = ring(2 * params, 7), ring(4 * params, 7)  # bf16 parameters, fp32 gradients
        zero1 = predict(GPT3_XL, Strategy(dp=8, tp=1, pp=1, mbs=1, gbs=8, zero_stage=1), system).row(0)
        exposed = zero1["dp_comm_exposed_s"]
        if hidden:  # a fast network: only the first block's gather and the last block's reduce are exposed
            assert exposed == pytest.approx((gather + reduce) / GPT3_XL.layers)
            # FSDP2 reshards after every backward: each micro-batch gathers again.
            two = predict(GPT3_XL, Strategy(dp=8, tp=1, pp=1, mbs=1, gbs=16, zero_stage=1), system).row(0)
            assert two["dp_comm_exposed_s"] == pytest.approx((2 * gather + reduce) / GPT3_XL.layers)
        else:  # a slow one: all but the forward and backward windows
            assert (gather + reduce) * 0.999 < exposed < gather + reduce


def test_sequence_parallel_moves_the_same_tp_bytes_and_shards_the_pipeline_sends():
    base = Strategy(dp=1, tp=4, pp=2, mbs=2, gbs=8)
    plain = one(base)
    sp = one(dataclasses.replace(base, sequence_parallel=True))
    assert sp["tp_comm_s"] == pytest.approx(plain["tp_comm_s"])
    link = A100.intra_node
    bandwidth = link.bandwidth_gbps * 1e9 * link.efficiency
    # The native engine's tp ranks each send their local output: the whole activation, or 1/tp of it with
    # sequence parallelism (Megatron's profile scatters it over tp either way).
    message = 2 * 2048 * 2048 * 2  # mbs x seq x hidden x bf16
    send = link.latency_s + message / bandwidth
    sp_send = link.latency_s + message / 4 / bandwidth
    tied_gradient = 4 * 50304 * 2048 / 4  # fp32 gradient of this tp rank's embedding rows
    tied_sync = 2 * (link.latency_s + tied_gradient / 2 / bandwidth)  # all-reduce between 2 stages
    assert plain["pp_p2p_s"] == pytest.approx(2 * 4 * send + tied_sync)  # fwd and bwd send per micro-batch
    assert sp["pp_p2p_s"] == pytest.approx(2 * 4 * sp_send + tied_sync)
    megatron = predict(GPT3_XL, base, A100, backend="megatron-deepspeed").row(0)
    assert megatron["pp_p2p_s"] == pytest.approx(2 * 4 * sp_send + tied_sync)


@pytest.mark.parametrize(
    "name", ["a100_80g", "a100_80g_2gpu_node", "h100_80g", "h200_141g", "a6000_48g_pcie"]
)
def test_every_gpu_system_gives_finite_positive_splits(name):
    system = load_system(name)
    strategies = StrategyArray.from_strategies(
        [
            Strategy(dp=dp, tp=tp, pp=pp, mbs=2, gbs=64, zero_stage=z)
            for dp, tp, pp in ((16, 1, 1), (2, 4, 2))
            for z in (1, 3)
        ]
    )
    prediction = predict(GPT3_XL, strategies, system)
    for field in dataclasses.fields(prediction):
        values = np.asarray(getattr(prediction, field.name), dtype=float)
        assert np.all(np.isfinite(values)) and np.all(values >= 0), field.name
    assert np.all(prediction.dp_comm_exposed_s > 0)  # 16 and 2 data-parallel ranks


def test_elementwise_work_is_bound_by_the_slower_of_memory_and_vector_rate():
    strategy = Strategy(dp=1, tp=1, pp=1, mbs=1, gbs=1)
    slow_vector = dataclasses.replace(A100, gpu=dataclasses.replace(A100.gpu, vector_tflops={"bf16": 1e-3}))
    fast_vector = dataclasses.replace(A100, gpu=dataclasses.replace(A100.gpu, vector_tflops={"bf16": 1e6}))
    base = predict(GPT3_XL, strategy, A100).row(0)["compute_s"]
    assert predict(GPT3_XL, strategy, fast_vector).row(0)["compute_s"] == pytest.approx(base)
    assert predict(GPT3_XL, strategy, slow_vector).row(0)["compute_s"] > 2 * base
