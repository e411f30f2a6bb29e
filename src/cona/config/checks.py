"""The value checks of a config's model and training sections: one line naming the key for each refusal.

Apart from :mod:`cona.config` (which calls :func:`check_values` when it parses a config) to keep both
short; nothing here imports the config's types.
"""

from __future__ import annotations

import math
import re
from typing import Any

from cona.errors import ConfigError

MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")
"""What ``model.name`` may be: it names ``checkpoints/<run_name>/<name>/`` under the workdir."""


def check_values(model: Any, training: Any, where: str) -> None:
    """Refuse a model or training value out of range (``model``: a ModelConfig, ``training``: a
    TrainingConfig)."""
    _check_model(model, where)
    _check_training(model, training, where)
    _check_lr(training, where)


def _check_model(model: Any, where: str) -> None:
    def fail(key: str, why: str) -> None:
        raise ConfigError(f"{where}: {key}: {why}")

    if not MODEL_NAME.fullmatch(model.name):
        fail(
            "model.name",
            f"{model.name!r} is not a plain directory name (it names checkpoints/<run_name>/<name>/ under "
            "--workdir): use letters, digits and . _ + -, starting with a letter or digit",
        )
    for key in ("layers", "hidden", "heads", "seq", "make_vocab_size_divisible_by"):
        if getattr(model, key) <= 0:
            fail(f"model.{key}", "must be positive")
    if model.hidden % model.heads:
        fail("model.hidden", f"{model.hidden} is not divisible by model.heads={model.heads}")
    if model.kv_heads <= 0:
        fail("model.kv_heads", "must be positive")
    if model.heads % model.kv_heads:
        fail("model.kv_heads", f"{model.kv_heads} does not divide model.heads={model.heads}")
    if model.rope_theta <= 0:
        fail("model.rope_theta", "must be positive")
    if model.position_embedding == "rope" and model.head_dim % 2:
        fail("model.position_embedding", f"rope needs an even head size, hidden/heads is {model.head_dim}")
    if model.ffn_hidden is not None and model.ffn_hidden <= 0:
        fail("model.ffn_hidden", "must be positive")
    if model.vocab_size is not None and model.vocab_size <= 0:
        fail("model.vocab_size", "must be positive")
    for key in ("attention_dropout", "hidden_dropout"):
        if not 0.0 <= getattr(model, key) < 1.0:
            fail(f"model.{key}", "must be in [0, 1)")
    if model.layernorm_epsilon <= 0:
        fail("model.layernorm_epsilon", "must be positive")
    if model.init_std <= 0:
        fail("model.init_std", "must be positive")


def _check_training(model: Any, training: Any, where: str) -> None:
    def fail(key: str, why: str) -> None:
        raise ConfigError(f"{where}: {key}: {why}")

    if training.zero_stage not in (0, 1, 2, 3):
        fail("training.zero_stage", f"{training.zero_stage} is not one of 0, 1, 2, 3")
    for key in (
        "base_gbs",
        "log_interval",
        "eval_interval",
        "eval_iters",
        "distributed_timeout_minutes",
        "fallback_patience",
        "probe_tokens",
        "pipeline_virtual_stages",
        "max_skipped_steps",
        "keep_checkpoints",
    ):
        if getattr(training, key) <= 0:
            fail(f"training.{key}", "must be positive")
    for key in ("save_interval", "save_interval_minutes"):
        if getattr(training, key) is not None and getattr(training, key) <= 0:
            fail(f"training.{key}", "must be positive (or null: no periodic checkpoints by this measure)")
    if training.eval_every_tokens is not None and training.eval_every_tokens <= 0:
        fail("training.eval_every_tokens", "must be positive (or null: every eval_interval iterations)")
    if training.divergence_loss_factor != 0 and training.divergence_loss_factor <= 1:
        fail("training.divergence_loss_factor", "must be above 1 (or 0: never)")
    for key in ("lr_decay_tokens", "lr_warmup_tokens"):
        value = getattr(training, key)
        if value is not None and value < 0:
            fail(f"training.{key}", "must be non-negative")
    if not 0 <= training.seed < 2**63:  # numpy seeds take non-negative integers, torch's at most 64 bits
        fail("training.seed", f"must be from 0 to 2**63 - 1, got {training.seed}")
    if training.weight_decay < 0.0:
        fail("training.weight_decay", "must be non-negative")
    for key in ("adam_beta1", "adam_beta2"):
        if not 0.0 <= getattr(training, key) < 1.0:
            fail(f"training.{key}", "must be in [0, 1)")
    if training.adam_eps <= 0:
        fail("training.adam_eps", "must be positive")
    if training.clip_grad < 0:
        fail("training.clip_grad", "must be non-negative (0 disables clipping)")
    try:
        split_fractions(training.split)
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None
    if training.pipeline_virtual_stages > 1 and training.pipeline_schedule != "interleaved_1f1b":
        fail("training.pipeline_virtual_stages", "needs pipeline_schedule 'interleaved_1f1b'")
    if model.family == "bert" and training.tokenizer_type != "BertWordPieceLowerCase":
        fail(
            "training.tokenizer_type",
            "model.family 'bert' needs 'BertWordPieceLowerCase' (masked-LM samples use [CLS]/[SEP]/[MASK])",
        )


def _check_lr(training: Any, where: str) -> None:
    def fail(key: str, why: str) -> None:
        raise ConfigError(f"{where}: {key}: {why}")

    if training.base_lr <= 0:
        fail("training.base_lr", "must be positive")
    if training.base_min_lr < 0:
        fail("training.base_min_lr", "must be non-negative")
    if training.base_lr < training.base_min_lr:
        fail(
            "training.base_lr",
            f"{training.base_lr} is smaller than training.base_min_lr={training.base_min_lr}",
        )
    if training.lr_scale_lr_cap is not None and training.lr_scale_lr_cap <= 0:
        fail("training.lr_scale_lr_cap", "must be positive")
    if training.lr_scale_strategy == "piecewise" and training.lr_scale_pivot_gbs is None:
        fail("training.lr_scale_pivot_gbs", "is required by lr_scale_strategy 'piecewise'")
    if training.lr_scale_pivot_gbs is not None and training.lr_scale_pivot_gbs <= 0:
        fail("training.lr_scale_pivot_gbs", "must be positive")
    if not 0.0 < training.fallback_ema_alpha <= 1.0:
        fail("training.fallback_ema_alpha", "must be in (0, 1]")
    if not training.probe_tolerance >= 0:
        fail("training.probe_tolerance", "must be non-negative (nats)")
    if not training.noise_scale_factor > 0:
        fail("training.noise_scale_factor", "must be positive")
    if not 0.0 <= training.lr_warmup_frac < 1.0:
        fail("training.lr_warmup_frac", "must be in [0, 1)")


def split_fractions(split: str) -> tuple[float, float, float]:
    """``"949,50,1"`` (or ``/``-separated) -> fractions summing to 1."""
    parts = re.split(r"[,/]", split)
    if len(parts) != 3:
        raise ConfigError(f"training.split: expected three numbers like '949,50,1', got {split!r}")
    try:
        weights = [float(part) for part in parts]
    except ValueError:
        raise ConfigError(f"training.split: expected three numbers like '949,50,1', got {split!r}") from None
    if any(w < 0 or not math.isfinite(w) for w in weights) or sum(weights) <= 0:
        raise ConfigError(f"training.split: weights must be non-negative with a positive sum, got {split!r}")
    total = sum(weights)
    return (weights[0] / total, weights[1] / total, weights[2] / total)
