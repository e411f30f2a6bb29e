"""The ``model`` section of a ``.conaconfig``: the network's shape, validated when it is built."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Literal, NoReturn

from cona.errors import ConfigError

FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    family: {"normalization": norm, "activation": activation, "position_embedding": positions, "bias": bias}
    for family, norm, activation, positions, bias in (
        ("gpt", "layernorm", "gelu", "learned", True),
        ("llama", "rmsnorm", "swiglu", "rope", False),
        ("bert", "layernorm", "gelu", "learned", True),
    )
}
"""What an unset key of the model section becomes for each ``model.family``; explicit keys win."""
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")
"""What ``model.name`` may be: one path component of ``checkpoints/<run_name>/<name>/`` under the workdir."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """The ``model`` section: the network's shape."""

    name: str = "gpt"
    """Model identifier; names the checkpoint directory ``checkpoints/<run_name>/<name>/...``."""
    family: Literal["gpt", "llama", "bert"] = "gpt"
    """``gpt`` and ``llama``: causal decoders trained on next-token prediction; ``bert``: a bidirectional
    encoder with Megatron's masked-LM head. Fills the unset keys below (:data:`FAMILY_DEFAULTS`)."""
    layers: int
    """Number of transformer blocks."""
    hidden: int
    """Hidden (model) size."""
    heads: int
    """Number of attention heads; must divide ``hidden``."""
    seq: int
    """Sequence length and number of learned position embeddings."""
    ffn_hidden: int | None = None
    """Feed-forward hidden size; 4 * hidden when omitted."""
    attention_dropout: float = 0.1
    """Dropout on attention probabilities."""
    hidden_dropout: float = 0.1
    """Dropout on the residual branches and embeddings."""
    normalization: Literal["layernorm", "rmsnorm"] | None = None
    """Normalisation layer of each block and the final norm; the family's (layernorm, llama: rmsnorm)
    when omitted."""
    activation: Literal["gelu", "swiglu"] | None = None
    """MLP: ``gelu`` (w1, w2) or ``swiglu`` (gate w1, up w3, down w2); llama's is swiglu."""
    position_embedding: Literal["learned", "rope"] | None = None
    """Learned absolute positions or rotary embeddings on q and k; llama's is rope."""
    rope_theta: float = 10000.0
    """Base of the rotary frequencies (Llama 3: 500000)."""
    kv_heads: int | None = None
    """Key/value heads (grouped-query attention when fewer than ``heads``, which they must divide);
    ``heads`` when omitted."""
    tie_embeddings: bool = True
    """Whether the output projection shares the token-embedding matrix."""
    bias: bool | None = None
    """Biases in the linear layers; llama has none."""
    layernorm_epsilon: float = 1e-5
    """Epsilon of the normalisation layers."""
    vocab_size: int | None = None
    """Tokenizer vocabulary; derived from ``training.vocab_file`` when omitted."""
    make_vocab_size_divisible_by: int = 128
    """The embedding is padded to a multiple of this (Megatron's rule), the same for every tp <= it."""
    init_std: float = 0.02
    """Standard deviation of the weight initialisation; output projections get std/sqrt(2*layers)."""

    def __post_init__(self) -> None:
        # The family fills what the file left unset (None), so an explicit key always wins.
        for key, value in FAMILY_DEFAULTS.get(self.family, FAMILY_DEFAULTS["gpt"]).items():
            if getattr(self, key) is None:
                object.__setattr__(self, key, value)
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        self._check_shape()
        self._check_numbers()

    def _check_shape(self) -> None:
        if not MODEL_NAME.fullmatch(self.name):
            _fail(
                "name",
                f"{self.name!r} is not a plain directory name (it names checkpoints/<run_name>/<name>/ under "
                "--workdir): use letters, digits and . _ + -, starting with a letter or digit",
            )
        for key in ("layers", "hidden", "heads", "seq", "make_vocab_size_divisible_by"):
            if getattr(self, key) <= 0:
                _fail(key, "must be positive")
        if self.hidden % self.heads:
            _fail("hidden", f"{self.hidden} is not divisible by model.heads={self.heads}")
        if self.kv_heads <= 0:
            _fail("kv_heads", "must be positive")
        if self.heads % self.kv_heads:
            _fail("kv_heads", f"{self.kv_heads} does not divide model.heads={self.heads}")
        if self.position_embedding == "rope" and self.head_dim % 2:
            _fail("position_embedding", f"rope needs an even head size, hidden/heads is {self.head_dim}")
        if self.ffn_hidden is not None and self.ffn_hidden <= 0:
            _fail("ffn_hidden", "must be positive")
        if self.vocab_size is not None and self.vocab_size <= 0:
            _fail("vocab_size", "must be positive")

    def _check_numbers(self) -> None:
        if self.rope_theta <= 0:
            _fail("rope_theta", "must be positive")
        for key in ("attention_dropout", "hidden_dropout"):
            if not 0.0 <= getattr(self, key) < 1.0:
                _fail(key, "must be in [0, 1)")
        if self.layernorm_epsilon <= 0:
            _fail("layernorm_epsilon", "must be positive")
        if self.init_std <= 0:
            _fail("init_std", "must be positive")

    @property
    def causal(self) -> bool:
        """Whether attention is causal (every family but the bidirectional ``bert``)."""
        return self.family != "bert"

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden if self.ffn_hidden is not None else 4 * self.hidden

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def padded_vocab_size(self) -> int:
        if self.vocab_size is None:
            raise ConfigError(
                "model.vocab_size is not known: set it, or set training.vocab_file to an existing "
                "GPT-2 vocab.json (cona data demo obtains one)"
            )
        divisor = self.make_vocab_size_divisible_by
        return math.ceil(self.vocab_size / divisor) * divisor


def _fail(key: str, why: str) -> NoReturn:
    raise ConfigError(f"model.{key}: {why}")
