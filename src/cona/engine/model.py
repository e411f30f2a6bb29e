"""The transformer of every family (GPT, Llama, BERT) in plain PyTorch; its parts are in ``layers``.

``model.family`` and its keys choose the variant: learned positions or rotary embeddings, GELU MLP or
SwiGLU, LayerNorm or RMSNorm, multi-head or grouped-query attention, biases or none, an output projection
tied to the token embedding or its own, causal (GPT, Llama) or bidirectional attention with Megatron's
masked-LM head (BERT). Every GPT parameter keeps its name; the other families only add names.

No distributed code lives here (torchtitan's rule): tensor, sequence and pipeline parallelism are applied
from outside (:mod:`cona.engine.parallelize`, :mod:`cona.engine.pipeline`) and keep every parameter name.
The loss is computed outside the model (mean token cross entropy in fp32, see ``train_model``).

A pipeline stage is this same class with some parts removed: ``embeds_inputs`` is True only on the first
stage (where token ids come in; it alone has ``pos_embeddings``), ``output`` (and the final norm and
masked-LM head) is None except on the last stage, and ``layers`` keeps only the stage's blocks under their
global keys.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from cona.config import ModelConfig
from cona.engine.layers import MaskedLMHead, RotaryEmbedding, TransformerBlock, make_norm

IGNORE_INDEX = -100
"""Target value of positions that carry no loss (BERT's unmasked tokens), as ``F.cross_entropy`` uses it."""


class GPT(nn.Module):
    """The model of any family: ``forward(tokens) -> logits`` over the padded vocabulary (a pipeline stage
    may map hidden states instead)."""

    def __init__(self, model: ModelConfig) -> None:
        super().__init__()
        self.config = model
        self.embeds_inputs = True
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(model.padded_vocab_size, model.hidden)
        self.pos_embeddings: nn.Embedding | None = (
            nn.Embedding(model.seq, model.hidden) if model.position_embedding == "learned" else None
        )
        self.embedding_dropout = nn.Dropout(model.hidden_dropout)
        rope = (
            RotaryEmbedding(model.head_dim, model.seq, model.rope_theta)
            if model.position_embedding == "rope"
            else None
        )
        self.layers = nn.ModuleDict({str(i): TransformerBlock(model, rope) for i in range(model.layers)})
        self.norm: nn.Module | None = make_norm(model)
        self.mlm_head: MaskedLMHead | None = MaskedLMHead(model) if model.family == "bert" else None
        # BERT's output projection has a bias of its own even when its weight is the tied embedding.
        self.output: nn.Linear | None = nn.Linear(
            model.hidden, model.padded_vocab_size, bias=model.family == "bert"
        )
        self.tie_output()

    def tie_output(self) -> None:
        """Make the LM head use the token-embedding matrix (again, after a parallel plan replaced it)."""
        tied = (
            not self.config.tie_embeddings
            or self.output is None
            or self.tok_embeddings is None
            or self.output.weight is self.tok_embeddings.weight
        )
        if not tied:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        h = inputs
        if self.embeds_inputs:  # first stage: token ids [b, s] -> hidden [b, s, d]
            h = self.tok_embeddings(inputs)
            if self.pos_embeddings is not None:
                h = h + self.pos_embeddings(torch.arange(inputs.shape[1], device=inputs.device))
            h = self.embedding_dropout(h)
        for layer in self.layers.values():
            h = layer(h)
        if self.output is not None:  # last stage: hidden -> logits
            h = self.norm(h)
            if self.mlm_head is not None:
                h = self.mlm_head(h)
            h = self.output(h)
        return h


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross entropy in fp32 over the targets that are not :data:`IGNORE_INDEX` (logits may be
    bf16, or vocab-sharded DTensors: loss_parallel)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX)


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
    communication), so peak extra memory is one parameter. A tied weight is visited once. The rotary
    tables are recomputed too.
    """
    for fqn, param in module.named_parameters():
        full = initial_value(model, fqn, param.shape, seed)
        if isinstance(param, DTensor):
            full = full.to(device=param.device_mesh.device_type, dtype=param.dtype)
            local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(local.to_local())
        else:
            param.copy_(full)
    for submodule in module.modules():  # tables that are not parameters (empty after to_empty)
        if isinstance(submodule, RotaryEmbedding):
            submodule.reset_buffers()
