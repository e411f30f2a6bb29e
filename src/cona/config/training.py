"""The ``training`` section of a ``.conaconfig``: flat in the file, grouped here by concept.

The file keeps the original CONA's flat keys (``training.base_lr``, ``training.probe_tokens``); in code each
key belongs to one small frozen section that checks its own values when it is built:
``training.optimizer`` (AdamW), ``training.lr`` (the learning rate and how it follows the batch),
``training.data`` (dataset and tokenizer), ``training.logging`` (metrics, evaluations, trackers),
``training.checkpoint`` (periodic saves), ``training.online`` (the online policy) and ``training.runtime``
(device, precision, parallel layout defaults, compilation, stop rules). Key names are unique across
sections, so a flat key names its section (:data:`SECTION_OF`) and an error names the flat key.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any, Literal, NoReturn

from cona.errors import ConfigError

DTYPES = ("fp32", "bf16", "fp16")
RECOMPUTE = ("none", "selective", "full")


def _fail(key: str, why: str) -> NoReturn:
    raise ConfigError(f"training.{key}: {why}")


def _require_positive(section: Any, *keys: str) -> None:
    for key in keys:
        if getattr(section, key) <= 0:
            _fail(key, "must be positive")


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerConfig:
    """AdamW and gradient clipping."""

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

    def __post_init__(self) -> None:
        if self.weight_decay < 0.0:
            _fail("weight_decay", "must be non-negative")
        for key in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, key) < 1.0:
                _fail(key, "must be in [0, 1)")
        _require_positive(self, "adam_eps")
        if self.clip_grad < 0:
            _fail("clip_grad", "must be non-negative (0 disables clipping)")


@dataclass(frozen=True, kw_only=True, slots=True)
class LRConfig:
    """The learning rate: its values at the base batch, how it follows a batch change, warm-up and decay."""

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
    lr_decay_tokens: int | None = None
    """Tokens of the cosine decay; the planned tokens of the run when omitted."""
    lr_warmup_frac: float = 0.01
    """Warmup as a fraction of the planned training (used unless lr_warmup_tokens is set)."""
    lr_warmup_tokens: int | None = None
    """Warmup length in tokens; overrides lr_warmup_frac."""

    def __post_init__(self) -> None:
        _require_positive(self, "base_gbs", "base_lr")
        if self.base_min_lr < 0:
            _fail("base_min_lr", "must be non-negative")
        if self.base_lr < self.base_min_lr:
            _fail("base_lr", f"{self.base_lr} is smaller than training.base_min_lr={self.base_min_lr}")
        if self.lr_scale_lr_cap is not None and self.lr_scale_lr_cap <= 0:
            _fail("lr_scale_lr_cap", "must be positive")
        if self.lr_scale_strategy == "piecewise" and self.lr_scale_pivot_gbs is None:
            _fail("lr_scale_pivot_gbs", "is required by lr_scale_strategy 'piecewise'")
        if self.lr_scale_pivot_gbs is not None and self.lr_scale_pivot_gbs <= 0:
            _fail("lr_scale_pivot_gbs", "must be positive")
        for key in ("lr_decay_tokens", "lr_warmup_tokens"):
            value = getattr(self, key)
            if value is not None and value < 0:
                _fail(key, "must be non-negative")
        if not 0.0 <= self.lr_warmup_frac < 1.0:
            _fail("lr_warmup_frac", "must be in [0, 1)")


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    """The dataset, its split and the tokenizer it was made with."""

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

    def __post_init__(self) -> None:
        split_fractions(self.split)


def split_fractions(split: str) -> tuple[float, float, float]:
    """``"949,50,1"`` (or ``/``-separated) -> fractions summing to 1."""
    parts = re.split(r"[,/]", split)
    if len(parts) != 3:
        _fail("split", f"expected three numbers like '949,50,1', got {split!r}")
    try:
        weights = [float(part) for part in parts]
    except ValueError:
        raise ConfigError(f"training.split: expected three numbers like '949,50,1', got {split!r}") from None
    if any(w < 0 or not math.isfinite(w) for w in weights) or sum(weights) <= 0:
        _fail("split", f"weights must be non-negative with a positive sum, got {split!r}")
    total = sum(weights)
    return (weights[0] / total, weights[1] / total, weights[2] / total)


@dataclass(frozen=True, kw_only=True, slots=True)
class LoggingConfig:
    """What a run reports and where: metrics lines, evaluations, run directories, W&B and TensorBoard."""

    log_interval: int = 10
    """Iterations between metrics lines."""
    eval_interval: int = 100
    """Iterations between validation evaluations."""
    eval_every_tokens: int | None = None
    """Tokens between evaluations, in place of ``eval_interval``: stages at another gbs (chain steps, online
    switches) keep the same spacing in tokens, so a larger batch does not see its evaluations thin out."""
    eval_iters: int = 10
    """Validation batches per evaluation."""
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

    def __post_init__(self) -> None:
        _require_positive(self, "log_interval", "eval_interval", "eval_iters")
        if self.eval_every_tokens is not None and self.eval_every_tokens <= 0:
            _fail("eval_every_tokens", "must be positive (or null: every eval_interval iterations)")


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointConfig:
    """Periodic checkpoints inside a stage (a stage's end always saves one)."""

    save_interval: int | None = None
    """Iterations between periodic checkpoints inside a stage (null: none by iteration count)."""
    save_interval_minutes: float | None = 30.0
    """Minutes between periodic checkpoints inside a stage (null: none by time). Written in the background."""
    keep_checkpoints: int = 2
    """Periodic checkpoints kept per stage; older ones are removed once a newer one is complete."""

    def __post_init__(self) -> None:
        for key in ("save_interval", "save_interval_minutes"):
            if getattr(self, key) is not None and getattr(self, key) <= 0:
                _fail(key, "must be positive (or null: no periodic checkpoints by this measure)")
        _require_positive(self, "keep_checkpoints")


@dataclass(frozen=True, kw_only=True, slots=True)
class OnlineConfig:
    """How online mode decides a switch: the paired probe, the noise scale and the fallback to a smaller
    batch."""

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
    fallback: bool = False
    """Move back to a smaller gbs when the smoothed noise scale drops for long enough."""
    fallback_ema_alpha: float = 0.1
    """Weight of a new noise-scale measurement in the fallback EMA, in (0, 1]."""
    fallback_patience: int = 3
    """Consecutive evaluations of a dropping noise scale before falling back."""

    def __post_init__(self) -> None:
        _require_positive(self, "probe_tokens")
        if not self.probe_tolerance >= 0:
            _fail("probe_tolerance", "must be non-negative (nats)")
        if not self.noise_scale_factor > 0:
            _fail("noise_scale_factor", "must be positive")
        if not 0.0 < self.fallback_ema_alpha <= 1.0:
            _fail("fallback_ema_alpha", "must be in (0, 1]")
        _require_positive(self, "fallback_patience")


@dataclass(frozen=True, kw_only=True, slots=True)
class RuntimeConfig:
    """How the steps run: seed, device and precision, the parallel layout's defaults, compilation, and the
    rules that stop a run that cannot go on."""

    seed: int = 1234
    """Seed of weight init, data order and dropout."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """``auto`` picks CUDA when present."""
    dtype: Literal["fp32", "bf16", "fp16"] = "bf16"
    """Training precision on CUDA; CPU always trains in fp32."""
    zero_stage: int = 1
    """0: replicated; 1/2: FSDP2 without resharding after forward; 3: fully sharded."""
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
    distributed_timeout_minutes: int = 10
    """Timeout of collectives and of multi-node barriers."""
    max_skipped_steps: int = 10
    """Stop the run (non-zero exit) after this many consecutive steps skipped for non-finite gradients."""
    divergence_loss_factor: float = 10.0
    """Stop the run when a metrics line's mean loss exceeds this times the lowest one so far (0: never)."""

    def __post_init__(self) -> None:
        if not 0 <= self.seed < 2**63:  # numpy seeds take non-negative integers, torch's at most 64 bits
            _fail("seed", f"must be from 0 to 2**63 - 1, got {self.seed}")
        if self.zero_stage not in (0, 1, 2, 3):
            _fail("zero_stage", f"{self.zero_stage} is not one of 0, 1, 2, 3")
        _require_positive(self, "pipeline_virtual_stages", "distributed_timeout_minutes", "max_skipped_steps")
        if self.pipeline_virtual_stages > 1 and self.pipeline_schedule != "interleaved_1f1b":
            _fail("pipeline_virtual_stages", "needs pipeline_schedule 'interleaved_1f1b'")
        if self.divergence_loss_factor != 0 and self.divergence_loss_factor <= 1:
            _fail("divergence_loss_factor", "must be above 1 (or 0: never)")

    def compiles_on(self, device_type: str) -> bool:
        """Whether the model is compiled on this device: ``compile`` when set, else on CUDA only (on the GPU
        the fused kernels save more per step than compiling costs over a run; on the CPU compiling the small
        models CONA trains there costs more than it saves)."""
        return self.compile if self.compile is not None else device_type == "cuda"


SECTIONS: dict[str, type] = {
    "optimizer": OptimizerConfig,
    "lr": LRConfig,
    "data": DataConfig,
    "logging": LoggingConfig,
    "checkpoint": CheckpointConfig,
    "online": OnlineConfig,
    "runtime": RuntimeConfig,
}
"""The sections of :class:`TrainingConfig`, by attribute name, in the order the docs list them."""
SECTION_OF: dict[str, str] = {
    field.name: name for name, cls in SECTIONS.items() for field in dataclasses.fields(cls)
}
"""Each flat ``training`` key's section."""
assert len(SECTION_OF) == sum(len(dataclasses.fields(cls)) for cls in SECTIONS.values()), "a key twice"
DEFAULTS: dict[str, Any] = {
    field.name: field.default for cls in SECTIONS.values() for field in dataclasses.fields(cls)
}
"""Each flat ``training`` key's default."""


@dataclass(frozen=True, slots=True, init=False)
class TrainingConfig:
    """The ``training`` section, built from its flat keys (``TrainingConfig(base_lr=3e-4, device="cpu")``,
    as the file writes them; unset keys keep their defaults) and read by section
    (``training.lr.base_lr``)."""

    optimizer: OptimizerConfig
    """AdamW and gradient clipping."""
    lr: LRConfig
    """The learning rate at the base batch, its scaling rule, warm-up and decay."""
    data: DataConfig
    """Dataset, split and tokenizer."""
    logging: LoggingConfig
    """Metrics lines, evaluations, run directories, W&B and TensorBoard."""
    checkpoint: CheckpointConfig
    """Periodic checkpoints inside a stage."""
    online: OnlineConfig
    """The online policy: probe, noise scale, fallback."""
    runtime: RuntimeConfig
    """Seed, device, precision, parallel-layout defaults, compilation, stop rules."""

    def __init__(self, **keys: Any) -> None:
        unknown = sorted(set(keys) - SECTION_OF.keys())
        if unknown:
            raise TypeError(f"TrainingConfig: unknown training keys {unknown}")
        for name, cls in SECTIONS.items():
            values = {key: value for key, value in keys.items() if SECTION_OF[key] == name}
            object.__setattr__(self, name, cls(**values))

    def replace(self, **keys: Any) -> TrainingConfig:
        """A copy with the given flat keys changed (and checked again)."""
        return TrainingConfig(**{**self.to_flat(), **keys})

    def to_flat(self) -> dict[str, Any]:
        """Every key as the file writes it: ``{"base_lr": 0.0002, ...}``."""
        return {
            field.name: getattr(section, field.name)
            for section in self.sections()
            for field in dataclasses.fields(section)
        }

    def explicit_flat(self) -> dict[str, Any]:
        """:meth:`to_flat` without the keys at their defaults."""
        return {key: value for key, value in self.to_flat().items() if value != DEFAULTS[key]}

    def sections(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in SECTIONS)
