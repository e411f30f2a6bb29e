"""Parameter counts, FLOPs and activation sizes against hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest

from cona.config import ModelConfig
from cona.errors import PlanError
from cona.planner import flops

GPT2 = ModelConfig(layers=12, hidden=768, heads=12, seq=1024, vocab_size=50257)


def gpt2_params_by_hand() -> int:
    h, vocab, seq = 768, 50304, 1024  # 50257 padded to a multiple of 128
    block = (2 * h) + (h * 3 * h + 3 * h) + (h * h + h) + (2 * h) + (h * 4 * h + 4 * h) + (4 * h * h + h)
    return vocab * h + seq * h + 12 * block + 2 * h


def test_gpt2_124m_parameter_count():
    assert gpt2_params_by_hand() == 124_475_904
    assert flops.parameter_count(GPT2) == gpt2_params_by_hand()


def test_gpt2_training_flops_per_token_is_6n_plus_attention():
    expected = 6 * 124_475_904 + 12 * 12 * 768 * 1024
    assert flops.training_flops_per_token(GPT2) == pytest.approx(expected, rel=1e-12)


def test_gqa_and_gated_mlp_change_the_count_by_hand():
    base = flops.model_shape(GPT2)
    gqa = flops.model_shape(GPT2, kv_heads=4)
    kv_saved = 2 * (768 - 4 * 64) * (768 + 1)  # K and V projections, weights and biases
    assert flops.block_parameter_count(base) - flops.block_parameter_count(gqa) == kv_saved
    gated = flops.model_shape(GPT2, gated_mlp=True)
    assert flops.block_parameter_count(gated) - flops.block_parameter_count(base) == 768 * 3072 + 3072


def test_kv_heads_must_divide_heads():
    with pytest.raises(PlanError, match="kv_heads"):
        flops.model_shape(GPT2, kv_heads=5)


def test_block_gemm_flops_split_over_tp():
    shape = flops.model_shape(GPT2)
    one = sum(g.flops_per_token() for g in flops.block_gemms(shape, 1))
    assert one == 2 * 12 * 768 * 768  # 24 h^2 per token: qkv 3h^2, out h^2, fc1 4h^2, fc2 4h^2 (x2 FLOPs)
    four = sum(g.flops_per_token() for g in flops.block_gemms(shape, np.array([4])))
    assert four[0] == pytest.approx(one / 4)


def test_activation_bytes_match_korthikanti_formula():
    # s*b*h*(10 + 24/t + 5*a*s/(h*t)) bytes per 16-bit block with dropout: per token h*(10+24/t) + 5as/t.
    model = ModelConfig(layers=4, hidden=1024, heads=16, seq=2048, vocab_size=50257)
    shape = flops.model_shape(model)
    for tp in (1, 2, 8):
        got = flops.block_activation_bytes_per_token(shape, tp, False, 2, flash_attention=False)
        assert got == pytest.approx(1024 * (10 + 24 / tp) + 5 * 16 * 2048 / tp)
        megatron_sp = flops.block_activation_bytes_per_token(
            shape, tp, True, 2, flash_attention=False, shard_linear_inputs=True
        )
        assert megatron_sp == pytest.approx(1024 * 34 / tp + 5 * 16 * 2048 / tp)
        # PyTorch's sequence parallelism keeps the gathered QKV and fc1 inputs (2h bytes each).
        torch_sp = flops.block_activation_bytes_per_token(shape, tp, True, 2, flash_attention=False)
        assert torch_sp == pytest.approx(megatron_sp + 1024 * 4 * (1 - 1 / tp))
        selective = flops.block_activation_bytes_per_token(
            shape, tp, True, 2, flash_attention=False, keep_attention_scores=False, shard_linear_inputs=True
        )
        assert selective == pytest.approx(1024 * 34 / tp)


def test_flash_attention_keeps_no_seq_squared_scores():
    short = flops.model_shape(ModelConfig(layers=2, hidden=512, heads=8, seq=512, vocab_size=1000))
    long = flops.model_shape(ModelConfig(layers=2, hidden=512, heads=8, seq=8192, vocab_size=1000))
    for flash, same in ((True, True), (False, False)):
        a = flops.block_activation_bytes_per_token(short, 1, False, 2, flash_attention=flash)
        b = flops.block_activation_bytes_per_token(long, 1, False, 2, flash_attention=flash)
        assert bool(a == b) is same
