"""The model families chosen through ``.conaconfig``: Llama (RoPE, SwiGLU, GQA, RMSNorm, no biases) and BERT.

The Llama forward is checked against Hugging Face's LlamaForCausalLM built offline from the same weights.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cona.config import ModelConfig, TrainingConfig, parse_config
from cona.engine.model import GPT, IGNORE_INDEX, init_weights, token_cross_entropy
from cona.engine.parallel_dims import validate_layout
from cona.engine.pipeline import split_stage
from cona.errors import ConfigError, LayoutError
from cona.strategy import Strategy

LLAMA = ModelConfig(
    family="llama",
    layers=2,
    hidden=64,
    heads=4,
    kv_heads=2,
    ffn_hidden=96,
    seq=16,
    vocab_size=256,
    rope_theta=500000.0,
    attention_dropout=0.0,
    hidden_dropout=0.0,
)
BERT = ModelConfig(
    family="bert",
    layers=2,
    hidden=64,
    heads=4,
    seq=16,
    vocab_size=200,
    attention_dropout=0.0,
    hidden_dropout=0.0,
)
GPT_CONFIG = dataclasses.replace(BERT, family="gpt")


def built(config: ModelConfig, seed: int = 5) -> GPT:
    model = GPT(config)
    init_weights(model, config, seed)
    return model.eval()


def tokens(config: ModelConfig, rows: int = 2) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (rows, config.seq), generator=torch.Generator().manual_seed(1))


# ---- config ------------------------------------------------------------------------------------------------


def test_family_fills_unset_keys_and_explicit_keys_win() -> None:
    shape = {"layers": 2, "hidden": 64, "heads": 4, "seq": 16}
    llama = parse_config({"model": {**shape, "family": "llama"}}).model
    assert (llama.normalization, llama.activation, llama.position_embedding) == ("rmsnorm", "swiglu", "rope")
    assert (llama.bias, llama.kv_heads, llama.tie_embeddings, llama.causal) == (False, 4, True, True)
    mixed = parse_config(
        {"model": {**shape, "family": "llama", "normalization": "layernorm", "bias": True}}
    ).model
    assert (mixed.normalization, mixed.bias, mixed.activation) == ("layernorm", True, "swiglu")
    gpt = parse_config({"model": shape}).model
    assert (gpt.family, gpt.normalization, gpt.activation, gpt.position_embedding, gpt.bias) == (
        "gpt",
        "layernorm",
        "gelu",
        "learned",
        True,
    )
    bert = ModelConfig(**shape, family="bert")  # parse_config also wants BERT's tokenizer (data side)
    assert not bert.causal and bert.position_embedding == "learned"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"kv_heads": 3}, "model.kv_heads: 3 does not divide model.heads=4"),
        ({"kv_heads": 0}, "model.kv_heads: must be positive"),
        ({"rope_theta": 0}, "model.rope_theta: must be positive"),
        ({"family": "t5"}, "model.family: 't5' is not one of"),
        ({"activation": "relu"}, "model.activation: 'relu' is not one of"),
        ({"position_embedding": "alibi"}, "model.position_embedding: 'alibi' is not one of"),
        ({"tie_embeddings": "yes"}, "model.tie_embeddings: expected true or false"),
        ({"hidden": 60, "heads": 20, "position_embedding": "rope"}, "model.position_embedding: rope needs"),
    ],
)
def test_bad_model_keys_are_refused_naming_the_key(extra: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({"model": {"layers": 2, "hidden": 64, "heads": 4, "seq": 16, **extra}})


def test_tp_must_divide_kv_heads() -> None:
    config = dataclasses.replace(LLAMA, heads=8, kv_heads=2)
    validate_layout(config, TrainingConfig(), Strategy(dp=1, tp=2, pp=1, gbs=8, mbs=1))
    with pytest.raises(LayoutError, match="tp=4 does not divide model.kv_heads=2"):
        validate_layout(config, TrainingConfig(), Strategy(dp=1, tp=4, pp=1, gbs=8, mbs=1))


# ---- structure ---------------------------------------------------------------------------------------------


def test_llama_parameters_have_no_biases_and_llama_names() -> None:
    names = [name for name, _ in built(LLAMA).named_parameters()]
    block = [
        "attention_norm.weight", "attention.wq.weight", "attention.wk.weight", "attention.wv.weight",
        "attention.wo.weight", "ffn_norm.weight", "feed_forward.w1.weight", "feed_forward.w2.weight",
        "feed_forward.w3.weight",
    ]  # fmt: skip
    assert names == [
        "tok_embeddings.weight",
        *(f"layers.{i}.{n}" for i in range(2) for n in block),
        "norm.weight",
    ]
    attention = built(LLAMA).layers["0"].attention
    assert attention.wk.weight.shape == attention.wv.weight.shape == (2 * 16, 64)  # kv_heads * head_dim
    assert not any(name.startswith("layers.0.attention.rope") for name in built(LLAMA).state_dict())


def test_untied_head_is_its_own_parameter() -> None:
    model = built(dataclasses.replace(LLAMA, tie_embeddings=False))
    assert model.output.weight is not model.tok_embeddings.weight
    assert not torch.equal(model.output.weight, model.tok_embeddings.weight)  # seeded by its own name


def test_bert_has_the_masked_lm_head_with_an_output_bias() -> None:
    names = [name for name, _ in built(BERT).named_parameters()]
    assert names[-7:] == [
        "norm.weight",
        "norm.bias",
        "mlm_head.dense.weight",
        "mlm_head.dense.bias",
        "mlm_head.norm.weight",
        "mlm_head.norm.bias",
        "output.bias",
    ]
    model = built(BERT)
    assert model.output.weight is model.tok_embeddings.weight


def test_fused_qkv_splits_grouped_widths() -> None:
    attention = built(dataclasses.replace(LLAMA, bias=True)).layers["1"].attention
    with torch.no_grad():
        for projection in (attention.wq, attention.wk, attention.wv):
            projection.bias.normal_()
    x = torch.randn(2, 16, 64)
    fused = attention._project_qkv(x)
    assert [t.shape[-1] for t in fused] == [64, 32, 32]
    for got, projection in zip(fused, (attention.wq, attention.wk, attention.wv), strict=True):
        torch.testing.assert_close(got, projection(x))


# ---- equations ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tie", [True, False])
def test_llama_matches_transformers_llama(tie: bool) -> None:
    transformers = pytest.importorskip("transformers")
    # A larger init than training's makes attention far from uniform, so RoPE and GQA errors would show.
    config = dataclasses.replace(LLAMA, tie_embeddings=tie, init_std=0.1)
    ours = built(config)
    reference_config = transformers.LlamaConfig(
        vocab_size=config.padded_vocab_size,
        hidden_size=config.hidden,
        intermediate_size=config.ffn_size,
        num_hidden_layers=config.layers,
        num_attention_heads=config.heads,
        num_key_value_heads=config.kv_heads,
        max_position_embeddings=config.seq,
        rms_norm_eps=config.layernorm_epsilon,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        tie_word_embeddings=tie,
        attention_bias=False,
        mlp_bias=False,
    )
    reference_config._attn_implementation = "eager"  # explicit softmax, independent of SDPA
    reference = transformers.LlamaForCausalLM(reference_config).eval()
    reference.load_state_dict({_hf_name(k): v for k, v in ours.state_dict().items()}, strict=True)
    inputs = tokens(config)
    with torch.no_grad():
        expected = reference(input_ids=inputs).logits
        got = ours(inputs)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def _hf_name(name: str) -> str:
    """Our parameter name -> Hugging Face Llama's."""
    renames = {
        "tok_embeddings": "model.embed_tokens",
        "norm.weight": "model.norm.weight",
        "output": "lm_head",
        "attention_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attention.wq": "self_attn.q_proj",
        "attention.wk": "self_attn.k_proj",
        "attention.wv": "self_attn.v_proj",
        "attention.wo": "self_attn.o_proj",
        "feed_forward.w1": "mlp.gate_proj",
        "feed_forward.w3": "mlp.up_proj",
        "feed_forward.w2": "mlp.down_proj",
    }
    if name.startswith("layers."):
        _, index, rest = name.split(".", 2)
        module, leaf = rest.rsplit(".", 1)
        return f"model.layers.{index}.{renames[module]}.{leaf}"
    module, leaf = name.split(".", 1)
    return renames.get(name) or f"{renames[module]}.{leaf}"


@pytest.mark.parametrize(("config", "sees_the_future"), [(BERT, True), (GPT_CONFIG, False), (LLAMA, False)])
def test_only_bert_attends_to_later_tokens(config: ModelConfig, sees_the_future: bool) -> None:
    model = built(config)
    inputs = tokens(config)
    changed = inputs.clone()
    changed[:, -1] = (changed[:, -1] + 1) % config.vocab_size
    with torch.no_grad():
        before, after = model(inputs)[:, 0], model(changed)[:, 0]
    assert (not torch.allclose(before, after)) == sees_the_future


def test_loss_ignores_positions_marked_ignore_index() -> None:
    logits = torch.randn(2, 3, 10)
    targets = torch.tensor([[1, IGNORE_INDEX, 3], [IGNORE_INDEX, 5, IGNORE_INDEX]])
    keep = targets != IGNORE_INDEX
    expected = torch.nn.functional.cross_entropy(logits[keep], targets[keep])
    torch.testing.assert_close(token_cross_entropy(logits, targets), expected)


@pytest.mark.parametrize("config", [LLAMA, dataclasses.replace(LLAMA, tie_embeddings=False), BERT])
def test_pipeline_stages_compose_to_the_whole_model(config: ModelConfig) -> None:
    whole = built(config)
    first, last = (split_stage(built(config), stage, 2) for stage in (0, 1))
    assert first.output is None and first.norm is None and first.mlm_head is None
    assert (last.tok_embeddings is not None) == config.tie_embeddings and last.pos_embeddings is None
    inputs = tokens(config)
    with torch.no_grad():
        torch.testing.assert_close(last(first(inputs)), whole(inputs))
