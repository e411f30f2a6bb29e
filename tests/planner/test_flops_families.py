"""The planner's counts for the paper's other two models, against hand counts written from the equations.

Llama-3.2-1B: 16 layers, hidden 2048, SwiGLU ffn 8192, 32 heads with 8 key/value heads (head size 64), vocab
128256 (already a multiple of 128), rotary positions, RMSNorm, no biases, tied embeddings.
BERT-Large: 24 layers, hidden 1024, 16 heads, ffn 4096, vocab 30522 padded to 30592, seq 512, learned
positions, LayerNorm, biases, tied embeddings and Megatron's masked-LM head (dense, norm, output bias).
"""

from __future__ import annotations

import dataclasses

import pytest

from cona.config import ModelConfig
from cona.planner import flops
from cona.planner.perf_model import GIB, predict
from cona.planner.systems import load_system
from cona.strategy import Strategy

LLAMA_1B = ModelConfig(
    family="llama",
    layers=16,
    hidden=2048,
    ffn_hidden=8192,
    heads=32,
    kv_heads=8,
    seq=2048,
    vocab_size=128256,
    rope_theta=500000.0,
)
BERT_LARGE = ModelConfig(
    family="bert", layers=24, hidden=1024, heads=16, ffn_hidden=4096, seq=512, vocab_size=30522
)


def llama_params_by_hand() -> int:
    layers, h, f, kv, vocab = 16, 2048, 8192, 8 * 64, 128256
    attention = h * h + 2 * h * kv + h * h  # q, k and v (kv_heads * head_dim wide), o; no biases
    mlp = 3 * h * f  # gate w1, up w3, down w2
    norms = 2 * h  # two RMSNorm weights
    return vocab * h + layers * (attention + mlp + norms) + h  # tied embedding, final norm, no positions


def bert_params_by_hand() -> int:
    layers, h, f, vocab, seq = 24, 1024, 4096, 30592, 512
    attention = (h * 3 * h + 3 * h) + (h * h + h)
    mlp = (h * f + f) + (f * h + h)
    norms = 2 * (2 * h)  # two LayerNorms, weight and bias
    embeddings = vocab * h + seq * h + 2 * h  # tied token embedding, learned positions, final LayerNorm
    mlm_head = (h * h + h) + 2 * h + vocab  # dense, its LayerNorm, the output bias
    return embeddings + layers * (attention + mlp + norms) + mlm_head


def test_llama_1b_parameters_are_the_published_size() -> None:
    assert llama_params_by_hand() == 1_235_814_400  # Llama-3.2-1B's 1.24B parameters
    assert flops.parameter_count(LLAMA_1B) == llama_params_by_hand()


def test_llama_1b_training_flops_per_token() -> None:
    expected = 6 * llama_params_by_hand() + 12 * 16 * 2048 * 2048
    assert flops.training_flops_per_token(LLAMA_1B) == pytest.approx(expected, rel=1e-12)


def test_bert_large_parameters_and_training_flops_per_token() -> None:
    assert flops.parameter_count(BERT_LARGE) == bert_params_by_hand()
    expected = 6 * bert_params_by_hand() + 12 * 24 * 1024 * 512
    assert flops.training_flops_per_token(BERT_LARGE) == pytest.approx(expected, rel=1e-12)


def test_llama_block_gemms_count_grouped_kv_and_three_mlp_matrices() -> None:
    shape = flops.model_shape(LLAMA_1B)
    h, f, kv = 2048, 8192, 512
    by_name = {g.name: g.flops_per_token() for g in flops.block_gemms(shape, 2)}
    assert by_name["qkv"] == 2 * h * (h + 2 * kv) / 2
    assert by_name["fc1"] == 2 * h * (2 * f) / 2  # gate and up
    assert by_name["fc2"] == 2 * (f / 2) * h
    assert flops.block_weight_params(shape, 2) == (h * (h + 2 * kv) + h * h + 3 * h * f) / 2 + 2 * h


def test_attention_skips_the_masked_half_only_when_causal() -> None:
    llama, bert = flops.model_shape(LLAMA_1B), flops.model_shape(BERT_LARGE)
    assert flops.attention_flops_per_token(llama, 1, causal_skip=True) == 4 * 2048 * 2048 / 2
    assert flops.attention_flops_per_token(bert, 1, causal_skip=True) == 4 * 512 * 1024
    assert flops.attention_flops_per_token(bert, 4, causal_skip=False) == 4 * 512 * 1024 / 4


def test_bert_head_includes_the_dense_transform() -> None:
    bert = flops.model_shape(BERT_LARGE)
    assert flops.lm_head_flops_per_token(bert, 2) == 2 * 1024 * 30592 / 2 + 2 * 1024 * 1024
    llama = flops.model_shape(LLAMA_1B)
    assert flops.lm_head_flops_per_token(llama, 1) == 2 * 2048 * 128256


def test_an_untied_head_adds_its_matrix() -> None:
    untied = dataclasses.replace(LLAMA_1B, tie_embeddings=False)
    assert flops.parameter_count(untied) - flops.parameter_count(LLAMA_1B) == 128256 * 2048


@pytest.mark.parametrize(
    "model",
    [LLAMA_1B, dataclasses.replace(LLAMA_1B, tie_embeddings=False), BERT_LARGE],
    ids=["llama", "llama untied", "bert"],
)
def test_one_gpu_holds_every_parameter_at_18_bytes_in_bf16(model: ModelConfig) -> None:
    row = predict(model, Strategy(dp=1, tp=1, pp=1, mbs=1, gbs=1, zero_stage=0), load_system("a100_80g")).row(
        0
    )
    state_bytes = (row["weights_gib"] + row["grads_gib"] + row["optimizer_gib"]) * GIB
    assert state_bytes == pytest.approx(18 * flops.parameter_count(model))
