"""GPT in plain PyTorch: learned positions, pre-norm blocks, GELU MLP, LM head tied to the token embedding.

No distributed code lives here (torchtitan's rule): tensor, sequence and pipeline parallelism are applied
from outside (:mod:`cona.engine.parallelize`, :mod:`cona.engine.pipeline`) and keep every parameter name.
Attention reshapes with ``view(b, s, -1, head_dim)`` so it runs unchanged on the heads local to a TP rank.
The loss is computed outside the model (mean token cross entropy in fp32, see ``train_model``).

A pipeline stage is this same class with some parts removed: ``pos_embeddings`` is None except on the
first stage (it marks where token ids come in), ``output`` is None except on the last stage, and
``layers`` keeps only the stage's blocks under their global keys.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from cona.config import ModelConfig


def _norm(model: ModelConfig) -> nn.Module:
    if model.normalization == "rmsnorm":
        return nn.RMSNorm(model.hidden, eps=model.layernorm_epsilon)
    return nn.LayerNorm(model.hidden, eps=model.layernorm_epsilon)


class CoreAttention(nn.Module):
    """Softmax(QK^T)V with a causal mask; a module of its own so selective recompute can wrap it."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.dropout = dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        dropout_p = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)


class Attention(nn.Module):
    def __init__(self, model: ModelConfig) -> None:
        super().__init__()
        self.head_dim = model.head_dim
        self.wq = nn.Linear(model.hidden, model.hidden)
        self.wk = nn.Linear(model.hidden, model.hidden)
        self.wv = nn.Linear(model.hidden, model.hidden)
        self.wo = nn.Linear(model.hidden, model.hidden)
        self.core = CoreAttention(model.attention_dropout)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x_BSD.shape
        # -1 heads: under TP each rank holds hidden/tp of the projections, i.e. heads/tp heads.
        q, k, v = (z.view(batch, seq, -1, self.head_dim).transpose(1, 2) for z in self._project_qkv(x_BSD))
        out_BHSd = self.core(q, k, v)
        return self.wo(out_BHSd.transpose(1, 2).reshape(batch, seq, -1))

    def _project_qkv(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k, v projections; one GEMM over the concatenated weights where they are plain tensors.

        One [3h, h] GEMM (forward, input grad and weight grad each) runs faster on a GPU than three [h, h]
        ones, while the parameters keep their names. The concatenation copies the weights once per
        forward, which is small next to the GEMM (3h^2 elements against 2 * tokens * 3h^2 flops) and which
        a compiled model fuses with the cast to the autocast dtype that it does anyway. Under TP the
        weights are DTensors sharded on their output dimension: each keeps its own column-parallel GEMM.
        """
        projections = (self.wq, self.wk, self.wv)
        if any(isinstance(p.weight, DTensor) for p in projections):
            return tuple(p(x_BSD) for p in projections)
        weight = torch.cat([p.weight for p in projections])
        bias = torch.cat([p.bias for p in projections])
        return F.linear(x_BSD, weight, bias).chunk(3, dim=-1)


class FeedForward(nn.Module):
    def __init__(self, model: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(model.hidden, model.ffn_size)
        self.w2 = nn.Linear(model.ffn_size, model.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


class TransformerBlock(nn.Module):
    def __init__(self, model: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = _norm(model)
        self.attention = Attention(model)
        self.ffn_norm = _norm(model)
        self.feed_forward = FeedForward(model)
        self.dropout = nn.Dropout(model.hidden_dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attention(self.attention_norm(x)))
        return x + self.dropout(self.feed_forward(self.ffn_norm(x)))


class GPT(nn.Module):
    """GPT: ``forward(tokens) -> logits`` over the padded vocabulary (a pipeline stage may map hidden)."""

    def __init__(self, model: ModelConfig) -> None:
        super().__init__()
        self.config = model
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(model.padded_vocab_size, model.hidden)
        self.pos_embeddings: nn.Embedding | None = nn.Embedding(model.seq, model.hidden)
        self.embedding_dropout = nn.Dropout(model.hidden_dropout)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(model) for i in range(model.layers)})
        self.norm: nn.Module | None = _norm(model)
        self.output: nn.Linear | None = nn.Linear(model.hidden, model.padded_vocab_size, bias=False)
        self.tie_output()

    def tie_output(self) -> None:
        """Make the LM head use the token-embedding matrix (again, after a parallel plan replaced it)."""
        tied = (
            self.output is None
            or self.tok_embeddings is None
            or self.output.weight is self.tok_embeddings.weight
        )
        if not tied:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        h = inputs
        if self.pos_embeddings is not None:  # first stage: token ids [b, s] -> hidden [b, s, d]
            positions = torch.arange(inputs.shape[1], device=inputs.device)
            h = self.embedding_dropout(self.tok_embeddings(inputs) + self.pos_embeddings(positions))
        for layer in self.layers.values():
            h = layer(h)
        if self.output is not None:  # last stage: hidden -> logits
            h = self.output(self.norm(h))
        return h


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross entropy in fp32 (logits may be bf16, or vocab-sharded DTensors: loss_parallel)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def parameter_seed(seed: int, fqn: str) -> int:
    """A stable 63-bit seed for one parameter, so its initial value depends only on (seed, name)."""
    digest = hashlib.sha256(f"{seed}:{fqn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def initial_value(model: ModelConfig, fqn: str, shape: torch.Size, seed: int) -> torch.Tensor:
    """The full fp32 initial tensor of parameter ``fqn`` (the same for every parallel layout)."""
    leaf = fqn.rsplit(".", 1)[-1]
    module_name = fqn.rsplit(".", 2)[-2]
    if leaf == "bias":
        return torch.zeros(shape)
    if "norm" in module_name:
        return torch.ones(shape)
    std = model.init_std
    if module_name in ("wo", "w2"):
        std = model.init_std / math.sqrt(2 * model.layers)
    generator = torch.Generator().manual_seed(parameter_seed(seed, fqn))
    return torch.randn(shape, generator=generator) * std


@torch.no_grad()
def init_weights(module: nn.Module, model: ModelConfig, seed: int) -> None:
    """Fill every parameter (plain or DTensor shard) with its layout-independent initial value.

    One full tensor is made at a time on the CPU from a generator seeded by (seed, FQN) and only the
    local shard is kept (``distribute_tensor`` with ``src_data_rank=None`` slices locally, no
    communication), so peak extra memory is one parameter. A tied weight is visited once.
    """
    for fqn, param in module.named_parameters():
        full = initial_value(model, fqn, param.shape, seed)
        if isinstance(param, DTensor):
            full = full.to(device=param.device_mesh.device_type, dtype=param.dtype)
            local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(local.to_local())
        else:
            param.copy_(full)
