"""The plain GPT: names, shapes, tying, layout-independent init, recompute."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from cona.config import ModelConfig
from cona.engine.model import GPT, init_weights, initial_value
from cona.engine.parallelize import apply_ac
from cona.engine.pipeline import split_stage
from cona.engine.train_model import token_cross_entropy

CONFIG = ModelConfig(
    layers=4, hidden=64, heads=4, seq=16, vocab_size=200, attention_dropout=0.0, hidden_dropout=0.0
)


def built(config: ModelConfig = CONFIG, seed: int = 5) -> GPT:
    model = GPT(config)
    init_weights(model, config, seed)
    return model


def batch(config: ModelConfig = CONFIG, rows: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(
        0, config.vocab_size, (rows, config.seq + 1), generator=torch.Generator().manual_seed(1)
    )
    return tokens[:, :-1], tokens[:, 1:]


def test_parameter_names_follow_the_contract() -> None:
    names = [name for name, _ in built().named_parameters()]
    block = [
        "attention_norm.weight", "attention_norm.bias",
        "attention.wq.weight", "attention.wq.bias", "attention.wk.weight", "attention.wk.bias",
        "attention.wv.weight", "attention.wv.bias", "attention.wo.weight", "attention.wo.bias",
        "ffn_norm.weight", "ffn_norm.bias",
        "feed_forward.w1.weight", "feed_forward.w1.bias", "feed_forward.w2.weight", "feed_forward.w2.bias",
    ]  # fmt: skip
    expected = ["tok_embeddings.weight", "pos_embeddings.weight"]
    expected += [f"layers.{i}.{name}" for i in range(4) for name in block] + ["norm.weight", "norm.bias"]
    assert names == expected  # output.weight is the tied embedding, listed once


def test_logits_cover_the_padded_vocabulary_and_the_head_is_tied() -> None:
    model = built()
    inputs, _ = batch()
    assert model(inputs).shape == (3, CONFIG.seq, 256)  # 200 padded to a multiple of 128
    assert model.output.weight is model.tok_embeddings.weight
    assert "output.weight" in model.state_dict()


def test_rmsnorm_and_ffn_hidden_options() -> None:
    config = dataclasses.replace(CONFIG, normalization="rmsnorm", ffn_hidden=96, layernorm_epsilon=1e-6)
    model = built(config)
    assert isinstance(model.norm, torch.nn.RMSNorm) and model.norm.eps == 1e-6
    assert model.layers["0"].feed_forward.w1.weight.shape == (96, 64)


def test_init_is_deterministic_and_follows_the_contract() -> None:
    a, b, other_seed = built(), built(), built(seed=6)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), other_seed.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        if name.endswith("weight") and "norm" not in name:
            assert not torch.equal(pa, pc), name
    big = ModelConfig(layers=8, hidden=256, heads=4, seq=16, vocab_size=200, init_std=0.03)
    assert initial_value(
        big, "layers.0.attention.wq.weight", torch.Size([256, 256]), 1
    ).std() == pytest.approx(0.03, rel=0.02)
    assert initial_value(big, "layers.3.feed_forward.w2.weight", torch.Size([256, 1024]), 1).std() == (
        pytest.approx(0.03 / math.sqrt(16), rel=0.02)
    )
    assert torch.equal(
        initial_value(big, "layers.0.attention.wo.bias", torch.Size([256]), 1), torch.zeros(256)
    )
    assert torch.equal(initial_value(big, "norm.weight", torch.Size([256]), 1), torch.ones(256))
    assert initial_value(big, "pos_embeddings.weight", torch.Size([16, 256]), 1).std() == pytest.approx(
        0.03, rel=0.05
    )


def test_pipeline_stages_get_the_same_weights_as_the_whole_model() -> None:
    whole = dict(built().named_parameters())
    for stage in range(3):
        with torch.device("meta"):
            part = GPT(CONFIG)
        split_stage(part, stage, 3)
        part.to_empty(device="cpu")
        part.tie_output()
        init_weights(part, CONFIG, 5)
        for name, param in part.named_parameters():
            assert torch.equal(param, whole[name]), (stage, name)
    assert set(dict(part.named_parameters())) >= {"tok_embeddings.weight", "norm.weight"}  # last stage
    assert part.output.weight is part.tok_embeddings.weight and part.pos_embeddings is None


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_keeps_names_loss_and_grads(mode: str) -> None:
    inputs, targets = batch()
    plain, recomputed = built(), built()
    apply_ac(recomputed, mode)
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in recomputed.named_parameters()]
    losses = []
    for model in (plain, recomputed):
        loss = token_cross_entropy(model(inputs), targets)
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    for p, q in zip(plain.parameters(), recomputed.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)


def test_dropout_is_active_in_training_only() -> None:
    config = dataclasses.replace(CONFIG, hidden_dropout=0.5, attention_dropout=0.5)
    model = built(config)
    inputs, _ = batch(config)
    torch.manual_seed(0)
    first = model(inputs)
    torch.manual_seed(1)
    assert not torch.allclose(first, model(inputs))
    model.eval()
    assert torch.equal(model(inputs), model(inputs))
