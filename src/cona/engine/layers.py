"""The layers of the transformer families (GPT, Llama, BERT), plain PyTorch without distributed code.

Attention reshapes with ``view(b, s, -1, head_dim)`` so it runs unchanged on the heads local to a TP rank:
column-parallel q/k/v projections hold ``heads/tp`` query heads and ``kv_heads/tp`` key/value heads, and
the grouping of grouped-query attention (query head ``i`` reads key/value head ``i // (heads/kv_heads)``)
maps local heads to local heads. Rotary embeddings act per head and position, so they need no change either.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from cona.config import ModelConfig


def make_norm(model: ModelConfig) -> nn.Module:
    if model.normalization == "rmsnorm":
        return nn.RMSNorm(model.hidden, eps=model.layernorm_epsilon)
    return nn.LayerNorm(model.hidden, eps=model.layernorm_epsilon)


class RotaryEmbedding(nn.Module):
    """cos/sin tables of rotary position embeddings, in the non-interleaved ("rotate half") convention.

    Channel ``j < d/2`` of a head is rotated together with channel ``j + d/2`` by angle
    ``position * theta^(-2j/d)``, as Hugging Face's Llama does (its checkpoints are stored for that
    convention). The tables are non-persistent buffers: they are not model state, so checkpoints do not
    change, and :meth:`reset_buffers` recomputes them after a model built on the meta device is materialised.
    """

    def __init__(self, head_dim: int, seq: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.seq, self.theta = head_dim, seq, theta
        self.register_buffer("cos", torch.empty(seq, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(seq, head_dim), persistent=False)
        if not self.cos.is_meta:
            self.reset_buffers()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        device = self.cos.device
        channels = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float()
        exponents = channels / self.head_dim
        inverse_frequency = 1.0 / (self.theta**exponents)
        positions = torch.arange(self.seq, dtype=torch.float32, device=device)
        angles = torch.outer(positions, inverse_frequency)
        angles = torch.cat((angles, angles), dim=-1)  # [seq, head_dim]: both halves share a frequency
        self.cos.copy_(angles.cos())
        self.sin.copy_(angles.sin())

    def forward(self, x_BHSd: torch.Tensor) -> torch.Tensor:
        seq = x_BHSd.shape[2]
        cos, sin = self.cos[:seq].to(x_BHSd.dtype), self.sin[:seq].to(x_BHSd.dtype)
        first, second = x_BHSd.chunk(2, dim=-1)
        return x_BHSd * cos + torch.cat((-second, first), dim=-1) * sin


class CoreAttention(nn.Module):
    """Softmax(QK^T)V, causal or bidirectional; a module of its own so selective recompute can wrap it."""

    def __init__(self, dropout: float, *, causal: bool, grouped: bool) -> None:
        super().__init__()
        self.dropout, self.causal, self.grouped = dropout, causal, grouped

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        dropout_p = self.dropout if self.training else 0.0
        # enable_gqa reads key/value head i // (heads / kv_heads) without copying them; of the CUDA kernels
        # only flash (and math) support it, so grouped attention on a GPU runs the flash kernel.
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=self.causal, dropout_p=dropout_p, enable_gqa=self.grouped
        )


class Attention(nn.Module):
    """Multi-head or grouped-query attention; ``wk``/``wv`` are ``kv_heads * head_dim`` wide."""

    def __init__(self, model: ModelConfig, rope: RotaryEmbedding | None) -> None:
        super().__init__()
        self.head_dim = model.head_dim
        kv_width = model.kv_heads * model.head_dim
        self.wq = nn.Linear(model.hidden, model.hidden, bias=model.bias)
        self.wk = nn.Linear(model.hidden, kv_width, bias=model.bias)
        self.wv = nn.Linear(model.hidden, kv_width, bias=model.bias)
        self.wo = nn.Linear(model.hidden, model.hidden, bias=model.bias)
        self.rope = rope  # one module shared by every block (its tables are not parameters)
        self.core = CoreAttention(
            model.attention_dropout, causal=model.causal, grouped=model.kv_heads != model.heads
        )

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x_BSD.shape
        # -1 heads: under TP each rank holds heads/tp query and kv_heads/tp key/value heads.
        q, k, v = (z.view(batch, seq, -1, self.head_dim).transpose(1, 2) for z in self._project_qkv(x_BSD))
        if self.rope is not None:
            q, k = self.rope(q), self.rope(k)
        out_BHSd = self.core(q, k, v)
        return self.wo(out_BHSd.transpose(1, 2).reshape(batch, seq, -1))

    def _project_qkv(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k, v projections; one GEMM over the concatenated weights where they are plain tensors.

        One [h + 2kv, h] GEMM (forward, input grad and weight grad each) runs faster on a GPU than three
        smaller ones, while the parameters keep their names. The concatenation copies the weights once per
        forward, which is small next to the GEMM and which a compiled model fuses with the cast to the
        autocast dtype that it does anyway. Under TP the weights are DTensors sharded on their output
        dimension: each keeps its own column-parallel GEMM.
        """
        projections = (self.wq, self.wk, self.wv)
        if any(isinstance(p.weight, DTensor) for p in projections):
            return tuple(p(x_BSD) for p in projections)
        weight = torch.cat([p.weight for p in projections])
        bias = torch.cat([p.bias for p in projections]) if self.wq.bias is not None else None
        widths = [p.out_features for p in projections]  # unequal under grouped-query attention
        return F.linear(x_BSD, weight, bias).split(widths, dim=-1)


class FeedForward(nn.Module):
    """GELU MLP (``w2(gelu(w1 x))``) or SwiGLU (``w2(silu(w1 x) * w3 x)``, Llama's names and order)."""

    def __init__(self, model: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(model.hidden, model.ffn_size, bias=model.bias)
        self.w2 = nn.Linear(model.ffn_size, model.hidden, bias=model.bias)
        gated = model.activation == "swiglu"
        self.w3 = nn.Linear(model.hidden, model.ffn_size, bias=model.bias) if gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is None:
            return self.w2(F.gelu(self.w1(x), approximate="tanh"))
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + attention(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, model: ModelConfig, rope: RotaryEmbedding | None) -> None:
        super().__init__()
        self.attention_norm = make_norm(model)
        self.attention = Attention(model, rope)
        self.ffn_norm = make_norm(model)
        self.feed_forward = FeedForward(model)
        self.dropout = nn.Dropout(model.hidden_dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attention(self.attention_norm(x)))
        return x + self.dropout(self.feed_forward(self.ffn_norm(x)))


class MaskedLMHead(nn.Module):
    """The transform Megatron's BERT applies before its output projection: dense h -> h, GELU, norm.

    GELU here is the exact (erf) one, Megatron's default in this head.
    """

    def __init__(self, model: ModelConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(model.hidden, model.hidden, bias=model.bias)
        self.norm = make_norm(model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(F.gelu(self.dense(x)))
