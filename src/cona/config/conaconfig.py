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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from cona.config.checks import check_values
from cona.config.fields import expect_section, reject_unknown, typed_values
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
"""``model.name`` is one path component under ``<workdir>/checkpoints/<run_name>/``: no ``/``, no ``..``."""
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
    probe: bool = True
    """Online mode decides a switch that keeps the layout by a paired probe: the next ``probe_tokens`` trained
    from one state at the current gbs and again at the candidate's (its LR by ``lr_scale_strategy``), each
    evaluated on the fixed evaluation set; the run continues from the branch that lowers the loss more per
    second. Off: such switches are decided by the noise-scale model alone, as layout changes always are."""
    probe_tokens: int = 131072
    """Tokens each branch of a probe trains (rounded up to whole steps of both batches). A probe costs the
    losing branch's time, about this many tokens at the current rate; with a probe repeated each time the
    run's tokens double, a candidate's probes cost at most twice its last one. Long enough that the
    branches' loss difference stands above the noise floor (the difference of two equal branches, which
    ``bench/probe_noise.py`` measures), short next to the run."""
    probe_tolerance: float = 0.01
    """Probe-loss difference (nats) within which two branches count as equal, so the faster wins: the
    critical-batch criterion of Merrill et al. 2025 (a larger batch is within its critical batch while its
    loss stays within 0.01 of the smaller batch's on the same tokens). Keep it above the noise floor."""
    noise_scale_factor: float = 1.0
    """Multiplies the measured noise scale wherever the efficiency ``(phi + base_gbs) / (phi + gbs)`` values
    a batch (online decisions, ``cona plan``): above 1 credits larger batches more. The engine measures
    McCandlish's ``B_simple``, which need not be the critical batch (Adam's is larger than SGD's). 1: the
    measurement as it is."""
    lr_decay_tokens: int | None = None
    """Tokens of the cosine decay; the planned tokens of the run when omitted."""
    lr_warmup_frac: float = 0.01
    """Warmup as a fraction of the planned training (used unless lr_warmup_tokens is set)."""
    lr_warmup_tokens: int | None = None
    """Warmup length in tokens; overrides lr_warmup_frac."""
    weight_decay: float = 0.1
    """AdamW weight decay (not applied to biases and norm weights)."""
    adam_beta1: float = 0.9
    """AdamW's first-moment decay."""
    adam_beta2: float = 0.95
    """AdamW's second-moment decay."""
    adam_eps: float = 1e-8
    """AdamW's epsilon."""
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
    """W&B project; W&B is off when omitted (``wandb_mode`` alone does not turn it on)."""
    wandb_dir: str | None = None
    """Where W&B writes its files (below it, W&B's own ``wandb/``); the run directory when omitted."""
    wandb_mode: Literal["online", "offline", "disabled"] = "offline"
    """W&B's mode when ``wandb_project`` is set (offline: synced later with ``wandb sync``)."""
    tensorboard_dir: str | None = None
    """TensorBoard event directory; off when omitted."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recomputation."""
    sequence_parallel: bool = False
    """Shard norms and dropout along the sequence when tp > 1."""
    pipeline_schedule: Literal["1f1b", "gpipe", "interleaved_1f1b"] = "1f1b"
    """Pipeline schedule when pp > 1."""
    pipeline_virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved 1F1B only)."""
    compile: bool | None = None
    """torch.compile the model: whole, with its loss, where neither split nor sharded; else per block.
    None (the default): on a GPU, off on the CPU (see :meth:`compiles_on`)."""
    compile_scope: Literal["auto", "model", "blocks"] = "auto"
    """What ``compile`` covers where the model is neither split nor sharded: ``model`` (one graph with the
    loss), ``blocks`` (each transformer block; its graph compiles in seconds and serves every block) or
    ``auto``: the whole model below 300M parameters, blocks above (see :mod:`cona.engine.step_modes`).
    Split or sharded models always compile per block."""
    cuda_graphs: bool = True
    """With ``compile`` on CUDA, where the whole model is compiled and a step is one micro-batch: replay its
    forward and backward as CUDA graphs (torch.compile mode "reduce-overhead"), which removes the per-kernel
    launch cost that bounds small models' steps."""

    def compiles_on(self, device_type: str) -> bool:
        """Whether the model is compiled on this device: ``compile`` when set, else on CUDA only (on the GPU
        a compiled step of a 125M GPT takes 11.2 ms against 28.5 ms eager; on the CPU compiling the small
        models CONA trains there costs more than it saves)."""
        return self.compile if self.compile is not None else device_type == "cuda"


@dataclass(frozen=True, kw_only=True, slots=True)
class ConaConfig:
    """A whole ``.conaconfig`` after validation."""

    model: ModelConfig
    training: TrainingConfig
    path: Path | None = field(default=None, compare=False)
    """The file it came from (None when built in code)."""
    overrides: tuple[str, ...] = field(default=(), compare=False)
    """The ``--set SECTION.KEY=VALUE`` given over the file's keys (already in ``model`` and ``training``;
    kept to pass on to the runners of the other nodes)."""

    def to_dict(self) -> dict[str, Any]:
        return {"model": _section_dict(self.model), "training": _section_dict(self.training)}

    def identity_dict(self) -> dict[str, Any]:
        """:meth:`to_dict` without the keys at their defaults: what a run directory is made for. A key that a
        later CONA adds at its default then leaves a run started before it resumable after the upgrade."""
        return {"model": _explicit_dict(self.model), "training": _explicit_dict(self.training)}


_TRAINING_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainingConfig)}


def _section_dict(section: Any) -> dict[str, Any]:
    return {f.name: getattr(section, f.name) for f in dataclasses.fields(section)}


def _explicit_dict(section: Any) -> dict[str, Any]:
    return {
        f.name: getattr(section, f.name)
        for f in dataclasses.fields(section)
        if f.default is dataclasses.MISSING or getattr(section, f.name) != f.default
    }


def parse_config(raw: Any, *, source: Path | None = None, where: str | None = None) -> ConaConfig:
    """Validate a decoded JSON object; ``source`` names the file in errors (``where`` instead, when given)
    and anchors relative paths."""
    where = where or (str(source) if source is not None else "<config>")
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
    check_values(model, training, where)
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
