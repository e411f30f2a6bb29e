"""Parameter counts, FLOPs and per-layer sizes of a transformer (GPT, Llama or BERT).

Everything here is exact arithmetic on the model's shape; the hardware enters in
:mod:`cona.planner.perf_model`. The shape helpers take a :class:`ModelShape`, which :func:`model_shape`
derives from a :class:`~cona.config.ModelConfig` of any family: grouped-query attention
(``kv_heads < heads``), a gated MLP (SwiGLU: three matrices, ``fc1`` twice as wide), linear layers without
biases, rotary positions (no position table), an untied output projection, and BERT's bidirectional
attention and masked-LM head. Functions that take a tensor-parallel degree accept an int or a numpy array of
degrees (the planner evaluates many strategies at once).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from cona.config import ModelConfig
from cona.errors import PlanError

NORM_PARAMS_PER_CHANNEL = {"layernorm": 2, "rmsnorm": 1}
"""LayerNorm has a weight and a bias per channel, RMSNorm only a weight."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelShape:
    """The sizes the planner needs, resolved from a model config (see :func:`model_shape`)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    """Key/value heads; ``heads`` for multi-head attention, fewer for grouped-query attention."""
    seq: int
    ffn: int
    """Feed-forward hidden size (the width of one of the gated MLP's two input projections)."""
    vocab: int
    """Padded vocabulary (the embedding and LM head rows)."""
    gated_mlp: bool = False
    """SwiGLU-style MLP: ``fc1`` produces gate and value (2 * ffn wide)."""
    norm_params: int = 2
    """Parameters per channel of one normalisation layer."""
    position_embeddings: bool = True
    """Learned absolute position embeddings (``seq * hidden`` parameters)."""
    attention_dropout: float = 0.1
    hidden_dropout: float = 0.1
    bias: bool = True
    """Biases in the linear layers of the blocks (and BERT's head transform)."""
    tied_embeddings: bool = True
    """The output projection shares the token-embedding matrix (else it is a second ``vocab x hidden``)."""
    causal: bool = True
    """Causal attention (a flash kernel skips the masked half); False for BERT's bidirectional encoder."""
    mlm_head: bool = False
    """BERT's masked-LM head: a dense ``hidden x hidden`` layer, GELU and a norm before the output
    projection, which has a ``vocab`` bias."""

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_width(self) -> int:
        """Width of the K projection (and of the V projection)."""
        return self.kv_heads * self.head_dim

    @property
    def fc1_width(self) -> int:
        return 2 * self.ffn if self.gated_mlp else self.ffn


def model_shape(
    model: ModelConfig | ModelShape, *, kv_heads: int | None = None, gated_mlp: bool | None = None
) -> ModelShape:
    """The shape of ``model``; ``kv_heads`` / ``gated_mlp`` override what the config says."""
    if isinstance(model, ModelShape):
        overrides = {"kv_heads": kv_heads, "gated_mlp": gated_mlp}
        return dataclasses.replace(model, **{k: v for k, v in overrides.items() if v is not None})
    resolved_kv = kv_heads if kv_heads is not None else model.kv_heads
    if resolved_kv <= 0 or model.heads % resolved_kv:
        raise PlanError(f"model.kv_heads: {resolved_kv} does not divide model.heads={model.heads}")
    return ModelShape(
        layers=model.layers,
        hidden=model.hidden,
        heads=model.heads,
        kv_heads=resolved_kv,
        seq=model.seq,
        ffn=model.ffn_size,
        vocab=model.padded_vocab_size,
        gated_mlp=gated_mlp if gated_mlp is not None else model.activation == "swiglu",
        norm_params=NORM_PARAMS_PER_CHANNEL[model.normalization],
        position_embeddings=model.position_embedding == "learned",
        attention_dropout=model.attention_dropout,
        hidden_dropout=model.hidden_dropout,
        bias=model.bias,
        tied_embeddings=model.tie_embeddings,
        causal=model.causal,
        mlm_head=model.family == "bert",
    )


def block_parameter_count(shape: ModelShape) -> int:
    """Parameters of one transformer block: attention, MLP (linears with biases unless ``bias`` is off) and
    two norms."""
    h, kv, f = shape.hidden, shape.kv_width, shape.ffn
    b = int(shape.bias)
    attention = h * (h + 2 * kv) + b * (h + 2 * kv) + h * h + b * h
    mlp = h * shape.fc1_width + b * shape.fc1_width + f * h + b * h
    norms = 2 * shape.norm_params * h
    return attention + mlp + norms


def embedding_parameter_count(shape: ModelShape) -> int:
    """Token embedding, position embedding, the final norm and the head: the output matrix when it is not
    tied to the embedding (a tied one is counted once), and BERT's masked-LM head."""
    positions = shape.seq * shape.hidden if shape.position_embeddings else 0
    embedding = shape.vocab * shape.hidden + positions + shape.norm_params * shape.hidden
    return embedding + head_parameter_count(shape)


def head_parameter_count(shape: ModelShape) -> int:
    """Parameters of the last stage's head beyond the final norm and a tied output matrix: an untied output
    matrix, and BERT's dense layer, its norm and the output bias."""
    h = shape.hidden
    untied = 0 if shape.tied_embeddings else shape.vocab * h
    mlm = h * h + int(shape.bias) * h + shape.norm_params * h + shape.vocab if shape.mlm_head else 0
    return untied + mlm


def parameter_count(model: ModelConfig | ModelShape) -> int:
    """All trainable parameters (GPT-2 124M: 124,439,808 with vocab 50257, 124,475,904 padded to 50304)."""
    shape = model_shape(model)
    return shape.layers * block_parameter_count(shape) + embedding_parameter_count(shape)


def training_flops_per_token(model: ModelConfig | ModelShape) -> float:
    """Model FLOPs of one trained token: ``6 * params + 12 * layers * hidden * seq``.

    The MFU convention of the reference benchmark (``gpt_ref.py``) and of the engine: 6N for the forward and
    backward matmuls of every parameter, plus the attention score and value products at full (non-causal)
    size. Recomputation is not counted: this is useful work, not executed work.
    """
    shape = model_shape(model)
    return 6.0 * parameter_count(shape) + 12.0 * shape.layers * shape.hidden * shape.seq


@dataclass(frozen=True, kw_only=True, slots=True)
class Gemm:
    """One weight matmul of a layer on one rank: ``2 * k * n`` FLOPs per token.

    Column-parallel layers split ``n`` over tp, row-parallel layers split ``k``.
    """

    name: str
    k: np.ndarray | float
    """Reduction size on one rank."""
    n: np.ndarray | float
    """Output width on one rank."""

    def flops_per_token(self) -> np.ndarray:
        return 2.0 * np.asarray(self.k, dtype=float) * np.asarray(self.n, dtype=float)


def block_gemms(shape: ModelShape, tp: np.ndarray | int) -> tuple[Gemm, ...]:
    """The four weight matmuls of a block on one tensor-parallel rank (Megatron's column/row split)."""
    tp = np.asarray(tp, dtype=float)
    h = shape.hidden
    return (
        Gemm(name="qkv", k=h, n=(h + 2 * shape.kv_width) / tp),
        Gemm(name="attn_out", k=h / tp, n=h),
        Gemm(name="fc1", k=h, n=shape.fc1_width / tp),
        Gemm(name="fc2", k=shape.ffn / tp, n=h),
    )


def attention_flops_per_token(shape: ModelShape, tp: np.ndarray | int, *, causal_skip: bool) -> np.ndarray:
    """Forward FLOPs of the score (QK^T) and value (PV) products per token on one rank.

    ``4 * seq * hidden / tp`` at full size, whatever ``kv_heads`` (every query head scores every key); a
    causal flash-attention kernel skips the masked half (``causal_skip``), a bidirectional model has none.
    """
    full = 4.0 * shape.seq * shape.hidden / np.asarray(tp, dtype=float)
    return full / 2.0 if causal_skip and shape.causal else full


def lm_head_flops_per_token(shape: ModelShape, tp: np.ndarray | int) -> np.ndarray:
    """Forward FLOPs of the LM head (vocab-parallel over tp) per token, with BERT's dense transform before
    it (replicated over tp, as Megatron has it)."""
    dense = 2.0 * shape.hidden * shape.hidden if shape.mlm_head else 0.0
    return 2.0 * shape.hidden * shape.vocab / np.asarray(tp, dtype=float) + dense


def block_weight_params(shape: ModelShape, tp: np.ndarray | int) -> np.ndarray:
    """Parameters of one block held by one tensor-parallel rank (norms and row-parallel biases replicated)."""
    tp = np.asarray(tp, dtype=float)
    h, kv, b = shape.hidden, shape.kv_width, int(shape.bias)
    attention = h * (h + 2 * kv) + b * (h + 2 * kv) + h * h
    split = attention + h * shape.fc1_width + b * shape.fc1_width + shape.ffn * h
    replicated = b * (h + h) + 2 * shape.norm_params * h  # attn_out and fc2 biases, two norms
    return split / tp + replicated


def block_activation_bytes_per_token(
    shape: ModelShape,
    tp: np.ndarray | int,
    sequence_parallel: np.ndarray | bool,
    dtype_bytes: int,
    *,
    flash_attention: bool,
    keep_attention_scores: np.ndarray | bool = True,
    shard_linear_inputs: bool = False,
) -> np.ndarray:
    """Bytes one block stores for its backward pass, per token, on one rank (no recomputation).

    Korthikanti et al. (2022) count ``s*b*h*(10 + 24/t + 5*a*s/(h*t))`` bytes for a GPT block in 16-bit with
    dropout; this is the same count written per token and generalised to GQA, a gated MLP, any dtype, dropout
    off, and flash attention (which keeps the softmax statistics, 4 bytes per head, instead of the s x s
    scores). ``keep_attention_scores=False`` is selective recomputation (the scores are recomputed).
    Sequence parallelism shards the norm inputs and dropout masks over tp. The inputs of the QKV and fc1
    linears stay gathered in PyTorch's sequence parallelism (CONA's engine saves the all-gathered input);
    Megatron re-gathers them in backward and stores them sharded (``shard_linear_inputs``, Korthikanti's
    34/t).
    """
    tp = np.asarray(tp, dtype=float)
    sp = np.asarray(sequence_parallel)
    h, e = shape.hidden, dtype_bytes
    mask = 1.0 if shape.hidden_dropout > 0 else 0.0
    norms_and_masks = 2 * h * e + 2 * h * mask  # replicated over tp unless sequence parallel
    linear_inputs = 2 * h * e  # replicated over tp unless sequence parallel and shard_linear_inputs
    split = (2 * h + 2 * shape.kv_width) * e + (shape.fc1_width + shape.ffn) * e  # q, k, v, attn out, mlp
    if flash_attention:
        scores = np.full_like(tp, 4.0 * shape.heads)
    else:
        attention_mask = 1.0 if shape.attention_dropout > 0 else 0.0
        full_scores = shape.heads * shape.seq * (2 * e + attention_mask)
        scores = np.where(np.asarray(keep_attention_scores), full_scores, 0.0)
    linear_shard = np.where(sp & shard_linear_inputs, tp, 1.0)
    return norms_and_masks / np.where(sp, tp, 1.0) + linear_inputs / linear_shard + (split + scores) / tp


@dataclass(frozen=True, kw_only=True, slots=True)
class ElementwiseWork:
    """A block's forward elementwise kernels per token on one rank (backward does about twice this).

    ``main``: norms, bias-dropout-adds, activation; ``scores``: softmax and dropout over the s x s attention
    scores (zero with flash attention, whose kernel keeps them on chip).
    """

    main_bytes: np.ndarray
    main_flops: np.ndarray
    score_bytes: np.ndarray
    score_flops: np.ndarray


NORM_FLOPS, RESIDUAL_DROPOUT_FLOPS, ACTIVATION_FLOPS, SOFTMAX_DROPOUT_FLOPS = 9.0, 2.0, 8.0, 6.0
"""FLOPs per element: a norm (mean, variance, scale, shift), dropout + residual add, GeLU/SiLU-and-gate,
softmax with its dropout."""


def block_elementwise_work(
    shape: ModelShape,
    tp: np.ndarray | int,
    sequence_parallel: np.ndarray | bool,
    dtype_bytes: int,
    *,
    flash_attention: bool,
) -> ElementwiseWork:
    """Bytes moved and FLOPs of a block's forward elementwise kernels per token on one rank.

    Fused kernels as in Megatron: norm (read, write), bias-dropout-add (read two, write one, plus a 1-byte
    mask), bias-activation (read fc1's output, write the activation). Norms and bias-dropout-adds are
    replicated over tp unless sequence parallel.
    """
    tp = np.asarray(tp, dtype=float)
    shard = np.where(np.asarray(sequence_parallel), tp, 1.0)
    h, e = shape.hidden, dtype_bytes
    mask = 1.0 if shape.hidden_dropout > 0 else 0.0
    replicated_bytes = 2 * (2 * h * e) + 2 * (3 * h * e + h * mask)
    replicated_flops = 2 * NORM_FLOPS * h + 2 * RESIDUAL_DROPOUT_FLOPS * h
    main_bytes = replicated_bytes / shard + (shape.fc1_width + shape.ffn) * e / tp
    main_flops = replicated_flops / shard + ACTIVATION_FLOPS * shape.ffn / tp
    scores = 0.0 if flash_attention else shape.heads * shape.seq / tp
    attention_mask = 1.0 if shape.attention_dropout > 0 else 0.0
    return ElementwiseWork(
        main_bytes=main_bytes,
        main_flops=main_flops,
        score_bytes=np.broadcast_to(scores * (4 * e + attention_mask), tp.shape),
        score_flops=np.broadcast_to(scores * SOFTMAX_DROPOUT_FLOPS, tp.shape),
    )
