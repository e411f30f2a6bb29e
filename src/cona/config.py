""".conaconfig: JSON with sections ``model`` and ``training`` -> frozen dataclasses.

Every key of the original CONA README's two tables (README.md, Configuration) is here, plus what the
engine needs. Validation lives in one place (:func:`parse_config`): unknown keys (with a "did you mean"),
wrong types, placeholders copied from that README's example (``"<num_layers>"``), numbers given as strings
and impossible values are refused with one line naming the file and the key. Relative paths are relative to
the file's directory.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from cona.config_fields import expect_section, read_json_file, reject_unknown, typed_values
from cona.errors import ConfigError

CONFIG_NAME = ".conaconfig"
LR_SCALE_STRATEGIES = ("linear", "sqrt", "adascale", "power", "piecewise")
DTYPES = ("fp32", "bf16", "fp16")
DEVICES = ("auto", "cpu", "cuda")
NORMALIZATIONS = ("layernorm", "rmsnorm")
MODEL_FAMILIES = ("gpt", "llama", "bert")
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    family: {"normalization": norm, "activation": activation, "position_embedding": positions, "bias": bias}
    for family, norm, activation, positions, bias in (
        ("gpt", "layernorm", "gelu", "learned", True),
        ("llama", "rmsnorm", "swiglu", "rope", False),
        ("bert", "layernorm", "gelu", "learned", True),
    )
}
"""What an unset key of the model section becomes for each ``model.family``; explicit keys win."""
RECOMPUTE = ("none", "selective", "full")
PIPELINE_SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b")
TOKENIZERS = ("GPT2BPETokenizer", "BertWordPieceLowerCase")
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")
"""``model.name`` is one path component under ``<workdir>/checkpoints/``: no separator, no ``..``."""
PATH_KEYS = (
    "data_prefix",
    "vocab_file",
    "merge_file",
    "data_cache_path",
    "log_root",
    "wandb_dir",
    "tensorboard_dir",
)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """The ``model`` section: the network's shape."""

    name: str = "gpt"
    """Model identifier; names the checkpoint directory ``checkpoints/<name>/...``."""
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


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingConfig:
    """The ``training`` section: optimisation, data, tokenizer, logging and runtime."""

    seed: int = 1234
    """Seed of weight init, data order and dropout."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """``auto`` picks CUDA when present."""
    zero_stage: int = 1
    """0: replicated; 1/2: FSDP2 without resharding after forward; 3: fully sharded."""
    dtype: Literal["fp32", "bf16", "fp16"] = "bf16"
    """Training precision on CUDA; CPU always trains in fp32."""
    base_gbs: int = 16
    """Global batch size (samples) that base_lr and base_min_lr are tuned for."""
    base_lr: float = 2e-4
    """Peak learning rate at base_gbs."""
    base_min_lr: float = 2e-5
    """Learning rate at the end of the cosine decay, at base_gbs."""
    scale_min_lr: bool = True
    """Whether min LR is scaled with the batch size too."""
    lr_scale_strategy: Literal["linear", "sqrt", "adascale", "power", "piecewise"] = "sqrt"
    """How the LR follows a global-batch change."""
    lr_scale_lr_cap: float | None = None
    """Upper bound of the scaled learning rate."""
    lr_scale_exp: float = 0.5
    """Exponent of the ``power`` rule: lr = base_lr * (gbs/base_gbs)**exp."""
    lr_scale_pivot_gbs: int | None = None
    """Pivot of the ``piecewise`` rule (required for it)."""
    lr_scale_low_exp: float = 1.0
    """``piecewise`` exponent up to the pivot."""
    lr_scale_high_exp: float = 0.5
    """``piecewise`` exponent above the pivot."""
    fallback: bool = False
    """Move back to a smaller gbs when the smoothed noise scale drops for long enough."""
    fallback_ema_alpha: float = 0.1
    """Weight of a new noise-scale measurement in the fallback EMA, in (0, 1]."""
    fallback_patience: int = 3
    """Consecutive evaluations of a dropping noise scale before falling back."""
    lr_decay_tokens: int | None = None
    """Tokens of the cosine decay; the planned tokens of the run when omitted."""
    lr_warmup_frac: float = 0.01
    """Warmup as a fraction of the planned training (used unless lr_warmup_tokens is set)."""
    lr_warmup_tokens: int | None = None
    """Warmup length in tokens; overrides lr_warmup_frac."""
    weight_decay: float = 0.1
    """AdamW weight decay (not applied to biases and norm weights)."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Global gradient-norm clipping threshold; 0 disables it."""
    split: str = "949,50,1"
    """Train/valid/test split of the documents, as three non-negative weights."""
    data_prefix: str | None = None
    """Indexed dataset path without ``.bin``/``.idx``."""
    vocab_file: str | None = None
    """GPT-2 ``vocab.json``, or a WordPiece ``vocab.txt`` (one token per line) for BertWordPieceLowerCase."""
    merge_file: str | None = None
    """GPT-2 ``merges.txt``."""
    tokenizer_type: Literal["GPT2BPETokenizer", "BertWordPieceLowerCase"] = "GPT2BPETokenizer"
    """How the data was tokenized; model.family ``bert`` needs BertWordPieceLowerCase ([CLS]/[SEP]/[MASK])."""
    data_cache_path: str | None = None
    """Where sample indices are cached; ``<data dir>/index-cache`` when omitted."""
    log_interval: int = 10
    """Iterations between metrics lines."""
    eval_interval: int = 100
    """Iterations between validation evaluations."""
    eval_every_tokens: int | None = None
    """Tokens between evaluations, in place of ``eval_interval``: stages at another gbs (chain steps, online
    switches) keep the same spacing in tokens, so a larger batch does not see its evaluations thin out."""
    eval_iters: int = 10
    """Validation batches per evaluation."""
    distributed_timeout_minutes: int = 10
    """Timeout of collectives and of multi-node barriers."""
    max_skipped_steps: int = 10
    """Stop the run (non-zero exit) after this many consecutive steps skipped for non-finite gradients."""
    divergence_loss_factor: float = 10.0
    """Stop the run when a metrics line's mean loss exceeds this times the lowest one so far (0: never)."""
    save_interval: int | None = None
    """Iterations between periodic checkpoints inside a stage (null: none by iteration count)."""
    save_interval_minutes: float | None = 30.0
    """Minutes between periodic checkpoints inside a stage (null: none by time). Written in the background."""
    keep_checkpoints: int = 2
    """Periodic checkpoints kept per stage; older ones are removed once a newer one is complete."""
    log_root: str = "logs"
    """Run directories are created under this."""
    wandb_project: str | None = None
    """W&B project; W&B is off when omitted."""
    wandb_dir: str | None = None
    wandb_mode: Literal["online", "offline", "disabled"] = "offline"
    tensorboard_dir: str | None = None
    """TensorBoard event directory; off when omitted."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recomputation."""
    sequence_parallel: bool = False
    """Shard norms and dropout along the sequence when tp > 1."""
    pipeline_schedule: Literal["1f1b", "gpipe", "interleaved_1f1b"] = "1f1b"
    pipeline_virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved 1F1B only)."""
    compile: bool | None = None
    """torch.compile the model: whole, with its loss, where neither split nor sharded; else per block.
    None (the default): on a GPU, off on the CPU (see :meth:`compiles_on`)."""
    cuda_graphs: bool = True
    """With ``compile`` on CUDA, where the whole model is compiled and a step is one micro-batch: replay its
    forward and backward as CUDA graphs (torch.compile mode "reduce-overhead"), which removes the per-kernel
    launch cost that bounds small models' steps."""

    def compiles_on(self, device_type: str) -> bool:
        """Whether the model is compiled on this device: ``compile`` when set, else on CUDA only (on the GPU
        a compiled step of a 125M GPT took 11.2 ms against 28.5 ms eager; on the CPU compiling the small
        models CONA trains there costs more than it saves)."""
        return self.compile if self.compile is not None else device_type == "cuda"


@dataclass(frozen=True, kw_only=True, slots=True)
class ConaConfig:
    """A whole ``.conaconfig`` after validation."""

    model: ModelConfig
    training: TrainingConfig
    path: Path | None = field(default=None, compare=False)
    """The file it came from (None when built in code)."""

    def to_dict(self) -> dict[str, Any]:
        return {"model": _section_dict(self.model), "training": _section_dict(self.training)}


_TRAINING_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainingConfig)}


def _section_dict(section: Any) -> dict[str, Any]:
    return {f.name: getattr(section, f.name) for f in dataclasses.fields(section)}


def find_config(start: Path | None = None) -> Path:
    """The ``.conaconfig`` in ``start`` (default: cwd) or its nearest parent."""
    here = (start or Path.cwd()).resolve()
    for directory in (here, *here.parents):
        candidate = directory / CONFIG_NAME
        if candidate.is_file():
            return candidate
    raise ConfigError(f"no {CONFIG_NAME} in {here} or any parent directory; pass --config PATH")


def load_config(path: Path | str | None = None, *, check_data_files: bool = False) -> ConaConfig:
    """Read, resolve and validate a config file (found from the cwd when ``path`` is None)."""
    config_path = Path(path) if path is not None else find_config()
    if config_path.is_dir():
        inside = config_path / CONFIG_NAME
        hint = f"; did you mean {inside}?" if inside.is_file() else f" (with no {CONFIG_NAME} in it)"
        raise ConfigError(f"config file {config_path} is a directory, not a {CONFIG_NAME} file{hint}")
    if not config_path.is_file():
        raise ConfigError(f"config file {config_path} does not exist")
    raw = read_json_file(config_path)
    config = parse_config(raw, source=config_path)
    if check_data_files:
        check_training_files(config)
    return config


def parse_config(raw: Any, *, source: Path | None = None) -> ConaConfig:
    """Validate a decoded JSON object; ``source`` names the file in errors and anchors relative paths."""
    where = str(source) if source is not None else "<config>"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: the top level must be an object with sections 'model' and 'training'")
    reject_unknown(raw, ("model", "training"), where, prefix="")
    if "model" not in raw:
        raise ConfigError(f"{where}: missing section 'model'")
    model_raw = expect_section(raw, "model", where)
    training_raw = expect_section(raw, "training", where) if "training" in raw else {}
    base_dir = source.parent if source is not None else Path.cwd()
    training_values = typed_values(TrainingConfig, training_raw, where, "training")
    for key in PATH_KEYS:
        # Defaults (log_root "logs") are relative to the file too, not to wherever cona was started.
        value = training_values.get(key, _TRAINING_DEFAULTS.get(key))
        if isinstance(value, str):
            training_values[key] = str((base_dir / Path(value).expanduser()).resolve())
    training = TrainingConfig(**training_values)
    model_values = typed_values(ModelConfig, model_raw, where, "model")
    # A missing vocab file leaves vocab_size unknown here: commands that need it (training, the
    # planner) refuse through check_training_files / ModelConfig.padded_vocab_size, naming the key.
    vocab_path = Path(training.vocab_file) if training.vocab_file is not None else None
    if model_values.get("vocab_size") is None and vocab_path is not None and vocab_path.is_file():
        model_values["vocab_size"] = vocab_size_from_file(vocab_path, where, training.tokenizer_type)
    model = ModelConfig(**model_values)
    _check_values(model, training, where)
    return ConaConfig(model=model, training=training, path=source)


def vocab_size_from_file(vocab_file: Path, where: str, tokenizer_type: str = "GPT2BPETokenizer") -> int:
    """Number of entries of a GPT-2 ``vocab.json`` (50257 for GPT-2) or lines of a WordPiece ``vocab.txt``."""
    try:
        if tokenizer_type == "BertWordPieceLowerCase":
            return len(vocab_file.read_text(encoding="utf-8").splitlines())
        return len(json.loads(vocab_file.read_text()))
    except FileNotFoundError:
        raise ConfigError(f"{where}: training.vocab_file: {vocab_file} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        kind = "UTF-8 WordPiece" if tokenizer_type == "BertWordPieceLowerCase" else "JSON"
        raise ConfigError(f"{where}: training.vocab_file: {vocab_file} is not a {kind} vocabulary") from None


def check_training_files(config: ConaConfig) -> None:
    """Refuse a config whose dataset or tokenizer files are missing, or whose data does not fit it (a
    validation split without a sample, token ids >= model.vocab_size): what ``cona train`` checks before it
    starts a worker."""
    where = str(config.path) if config.path else "<config>"
    training = config.training
    if training.data_prefix is None:
        raise ConfigError(f"{where}: training.data_prefix is required to train")
    for suffix in (".bin", ".idx"):
        if not Path(training.data_prefix + suffix).is_file():
            raise ConfigError(f"{where}: training.data_prefix: {training.data_prefix}{suffix} does not exist")
    for key in ("vocab_file", "merge_file"):
        value = getattr(training, key)
        if value is not None and not Path(value).is_file():
            raise ConfigError(f"{where}: training.{key}: {value} does not exist")
    from cona.data.checks import check_dataset  # the data modules import this one

    check_dataset(config)


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


def _check_values(model: ModelConfig, training: TrainingConfig, where: str) -> None:
    def fail(key: str, why: str) -> None:
        raise ConfigError(f"{where}: {key}: {why}")

    if not MODEL_NAME.fullmatch(model.name):
        fail(
            "model.name",
            f"{model.name!r} is not a plain directory name (it names checkpoints/<name>/ under --workdir): "
            "use letters, digits and . _ + -, starting with a letter or digit",
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
    if training.zero_stage not in (0, 1, 2, 3):
        fail("training.zero_stage", f"{training.zero_stage} is not one of 0, 1, 2, 3")
    for key in (
        "base_gbs",
        "log_interval",
        "eval_interval",
        "eval_iters",
        "distributed_timeout_minutes",
        "fallback_patience",
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
    if not 0.0 <= training.lr_warmup_frac < 1.0:
        fail("training.lr_warmup_frac", "must be in [0, 1)")
    for key in ("lr_decay_tokens", "lr_warmup_tokens"):
        value = getattr(training, key)
        if value is not None and value < 0:
            fail(f"training.{key}", "must be non-negative")
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
