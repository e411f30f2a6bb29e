"""The ``deepspeed`` launcher command, ``pretrain_gpt.py`` arguments and ``ds_config`` of one stage (pure).

Flags follow ``../shared/reference/megatron-deepspeed-formats.md`` section 1 and the CPU probe. What every
stage
of a chain must agree on lives in :class:`ChainShape`, so that a switch never trips one of Megatron's checks:

- ``--train-samples`` is the same in every stage (it sizes and names the data index, so the sample order is
  unchanged) and large enough that ``train_samples // gbs`` reaches every stage's stop; each stage stops with
  ``--train-tokens <tokens consumed at its stop iteration>``, so Megatron leaves its loop normally: it saves,
  then evaluates the validation and test draws (the "before" loss of switch verification, :mod:`.verify`).
- The LR schedule is token based (``--lr-warmup-tokens``/``--lr-decay-tokens``, the same tokens as the native
  engine's :func:`cona.engine.optim.lr_schedule`); the peak and minimum LR change with gbs, so stages after
  the
  first pass ``--override-opt_param-scheduler`` (the checkpoint's step counts are irrelevant to a token
  schedule).
- The vocabulary pads to the same size under every tp of the chain: Megatron pads to a multiple of
  ``divisor * tp``, so each stage gets ``divisor = multiple // tp`` with ``multiple = lcm(config divisor,
  tps)``.
  A tp-dependent size would change the softmax's dummy columns and the loss (defect C of the probe).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cona.config import ConaConfig, TrainingConfig
from cona.engine.optim import LRSchedule
from cona.errors import ConfigError, LayoutError
from cona.strategy import Strategy

# Fused CUDA kernels that have no CPU path (gradient accumulation fusion raises without its CUDA extension).
CPU_FUSION_OFF = (
    "--no-gradient-accumulation-fusion",
    "--no-masked-softmax-fusion",
    "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion",
)
STEPS_PER_PRINT = 1_000_000  # DeepSpeed's own progress lines would only duplicate Megatron's
NEVER = 1_000_000_000  # an interval no stage reaches


@dataclass(frozen=True, kw_only=True, slots=True)
class ChainShape:
    """What every stage of one run passes identically."""

    train_samples: int
    """``--train-samples``: constant, and >= every stage's stop iteration times its gbs."""
    vocab_multiple: int
    """The padded vocabulary is a multiple of this under every tp."""
    stop_tokens: tuple[int, ...]
    """Tokens consumed when each stage (in order) reaches its stop iteration: its ``--train-tokens``. Empty
    for an online run, whose stages are decided as it goes: each then stops at the run's token budget
    (``--train-tokens``) or its stop iteration (CONA's hooks in the launched processes)."""

    def stage_stop_tokens(self, stage: int, max_tokens: int | None) -> int | None:
        """``--train-tokens`` of stage ``stage``: the chain's planned tokens, else the run's budget."""
        return self.stop_tokens[stage - 1] if self.stop_tokens else max_tokens


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointLoad:
    """What a stage loads: ``--load directory --load-tag tag`` (+ ``--universal-checkpoint``)."""

    directory: Path
    tag: str
    universal: bool

    @classmethod
    def from_path(cls, path: Path) -> CheckpointLoad:
        """From a ``global_step<N>`` or ``global_step<N>_universal`` directory."""
        path = Path(path)
        if not path.name.startswith("global_step"):
            raise ConfigError(
                f"{path}: a Megatron-DeepSpeed stage loads a global_step<N>[_universal] directory"
            )
        return cls(directory=path.parent, tag=path.name, universal=path.name.endswith("_universal"))


@dataclass(frozen=True, kw_only=True, slots=True)
class StageArgs:
    """Everything of one launch that is not in the config or the strategy."""

    ds_config_path: Path
    stop_tokens: int | None
    """``--train-tokens``: train until this many tokens are consumed; None with ``skip_train``."""
    save_dir: Path | None
    load: CheckpointLoad | None
    schedule: LRSchedule
    override_scheduler: bool
    """Take the LR values of this command rather than the checkpoint's (every stage that loads one)."""
    device_type: str
    run_name: str
    skip_train: bool = False
    """Evaluation only (switch verification): load, evaluate the validation and test draws, exit."""
    eval_iters: int | None = None
    """Evaluation batches; training.eval_iters when None."""


def chain_shape(config: ConaConfig, stages: Iterable[tuple[Strategy, int]]) -> ChainShape:
    """The shape of a run whose stages are ``(strategy, stop iteration)`` in order."""
    stages = list(stages)
    if not stages:
        raise ValueError("a run has at least one stage")
    samples, start, largest, stop_tokens = 0, 0, 0, []
    for strategy, stop in stages:
        samples += (stop - start) * strategy.gbs
        largest = max(largest, stop * strategy.gbs)
        stop_tokens.append(samples * config.model.seq)
        start = stop
    tps = [strategy.tp for strategy, _ in stages]
    multiple = math.lcm(config.model.make_vocab_size_divisible_by, *tps)
    return ChainShape(
        train_samples=max(samples, largest), vocab_multiple=multiple, stop_tokens=tuple(stop_tokens)
    )


def online_shape(config: ConaConfig, *, world_size: int, max_samples: int) -> ChainShape:
    """The shape of an online run on ``world_size`` processes that consumes at most ``max_samples``
    samples: every tp a stage may choose (a divisor of the world size) pads the vocabulary alike, and
    ``--train-samples`` is that bound (Megatron's own iteration limit, ``train_samples // gbs``, must not stop
    a stage before CONA's stop rules do, so the caller's bound covers the most iterations any stage can
    reach)."""
    tps = [tp for tp in range(1, world_size + 1) if world_size % tp == 0]
    multiple = math.lcm(config.model.make_vocab_size_divisible_by, *tps)
    return ChainShape(train_samples=max_samples, vocab_multiple=multiple, stop_tokens=())


def vocab_divisor(shape: ChainShape, tp: int) -> int:
    if shape.vocab_multiple % tp:
        raise LayoutError(
            f"tp={tp} is not one of the run's tensor-parallel degrees (vocab multiple {shape.vocab_multiple})"
        )
    return shape.vocab_multiple // tp


def ds_config(strategy: Strategy, training: TrainingConfig, device_type: str) -> dict:
    """The DeepSpeed JSON: ``train_batch_size == micro batch * accumulation * dp`` (DeepSpeed asserts it)."""
    accumulation, remainder = divmod(strategy.gbs, strategy.mbs * strategy.dp)
    if remainder or accumulation < 1:
        raise LayoutError(f"gbs={strategy.gbs} is not a multiple of mbs*dp={strategy.mbs * strategy.dp}")
    config: dict = {
        "train_batch_size": strategy.gbs,
        "train_micro_batch_size_per_gpu": strategy.mbs,
        "gradient_accumulation_steps": accumulation,
        "steps_per_print": STEPS_PER_PRINT,
        "zero_optimization": {"stage": strategy.zero_stage},
        "gradient_clipping": training.optimizer.clip_grad,
        "wall_clock_breakdown": False,
    }
    precision = precision_of(training, device_type)
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
        config["data_types"] = {"grad_accum_dtype": "fp32"}  # selects BF16_Optimizer, as the UCP examples do
    elif precision == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    return config


def precision_of(training: TrainingConfig, device_type: str) -> str:
    """CPU trains in fp32 (as the native engine does); CUDA in the config's dtype."""
    return "fp32" if device_type == "cpu" else training.runtime.dtype


def check_supported(config: ConaConfig, strategy: Strategy, device_type: str) -> None:
    """Refuse what this backend cannot run, naming the config key (before anything is launched)."""
    model = config.model
    gpt_structure = {
        "family": (model.family, "gpt"),
        "activation": (model.activation, "gelu"),
        "position_embedding": (model.position_embedding, "learned"),
        "kv_heads": (model.kv_heads, model.heads),
        "tie_embeddings": (model.tie_embeddings, True),
        "bias": (model.bias, True),
    }
    for key, (value, supported) in gpt_structure.items():
        if value != supported:  # the generated pretrain_gpt.py arguments describe a GPT only
            raise ConfigError(
                f"model.{key}={value}: the Megatron-DeepSpeed backend trains the GPT of pretrain_gpt.py "
                f"({key} {supported}); use the native backend for this model"
            )
    if strategy.zero_stage != 1:
        raise ConfigError(
            f"training.zero_stage={strategy.zero_stage}: the Megatron-DeepSpeed backend runs the pipe model, "
            "whose universal checkpoints need ZeRO-1; set training.zero_stage: 1"
        )
    if device_type == "cpu" and config.model.normalization != "rmsnorm":
        raise ConfigError(
            "model.normalization=layernorm: Megatron-DeepSpeed's pipe model cannot build its final LayerNorm "
            "off CUDA (it passes sequence_parallel= to torch.nn.LayerNorm); set model.normalization: rmsnorm"
        )
    missing = [
        key
        for key in ("data_prefix", "vocab_file", "merge_file")
        if getattr(config.training.data, key) is None
    ]
    if missing:
        raise ConfigError(
            f"training.{missing[0]} is required by the Megatron-DeepSpeed backend (GPT2BPETokenizer files)"
        )
    if strategy.recompute != "none" or strategy.sequence_parallel or strategy.virtual_stages != 1:
        raise ConfigError(
            "training.recompute / sequence_parallel / pipeline_virtual_stages are not mapped to "
            "Megatron-DeepSpeed flags yet; use the native backend for them"
        )


def pretrain_args(config: ConaConfig, strategy: Strategy, shape: ChainShape, args: StageArgs) -> list[str]:
    """``pretrain_gpt.py`` arguments of one launch."""
    return [
        *_model_args(config, shape, strategy.tp),
        *_parallel_args(strategy),
        *_data_args(config.training),
        *_schedule_args(config.training, shape, args),
        *_checkpoint_args(args),
        *_logging_args(config.training, args),
        *_runtime_args(config.training, strategy, args),
    ]


def _model_args(config: ConaConfig, shape: ChainShape, tp: int) -> list[str]:
    model = config.model
    values = [
        "--num-layers", str(model.layers),
        "--hidden-size", str(model.hidden),
        "--num-attention-heads", str(model.heads),
        "--seq-length", str(model.seq),
        "--max-position-embeddings", str(model.seq),
        "--attention-dropout", repr(model.attention_dropout),
        "--hidden-dropout", repr(model.hidden_dropout),
        "--normalization", model.normalization,
        "--layernorm-epsilon", repr(model.layernorm_epsilon),
        "--init-method-std", repr(model.init_std),
        "--make-vocab-size-divisible-by", str(vocab_divisor(shape, tp)),
    ]  # fmt: skip
    if model.ffn_hidden is not None:
        values += ["--ffn-hidden-size", str(model.ffn_hidden)]
    return values


def _parallel_args(strategy: Strategy) -> list[str]:
    return [
        "--tensor-model-parallel-size", str(strategy.tp),
        "--pipeline-model-parallel-size", str(strategy.pp),
        "--micro-batch-size", str(strategy.mbs),
        "--global-batch-size", str(strategy.gbs),
    ]  # fmt: skip


def _data_args(training: TrainingConfig) -> list[str]:
    values = [
        "--data-path", str(training.data.data_prefix),
        "--data-impl", "mmap",
        "--split", training.data.split,
        "--tokenizer-type", training.data.tokenizer_type,
        "--vocab-file", str(training.data.vocab_file),
        "--merge-file", str(training.data.merge_file),
    ]  # fmt: skip
    if training.data.data_cache_path is not None:
        values += ["--data-cache-path", str(training.data.data_cache_path)]
    return values


def _schedule_args(training: TrainingConfig, shape: ChainShape, args: StageArgs) -> list[str]:
    schedule = args.schedule
    values = [
        "--train-samples", str(shape.train_samples),
        "--lr", repr(schedule.peak_lr),
        "--min-lr", repr(schedule.min_lr),
        "--lr-decay-style", "cosine",
        "--lr-warmup-tokens", str(schedule.warmup_tokens),
        "--lr-decay-tokens", str(schedule.decay_tokens),
        "--weight-decay", repr(training.optimizer.weight_decay),
        "--clip-grad", repr(training.optimizer.clip_grad),
        "--adam-beta1", repr(training.optimizer.adam_beta1),
        "--adam-beta2", repr(training.optimizer.adam_beta2),
        "--adam-eps", repr(training.optimizer.adam_eps),
        "--seed", str(training.runtime.seed),
    ]  # fmt: skip
    if args.override_scheduler:
        values.append("--override-opt_param-scheduler")
    if args.stop_tokens is not None:
        values += ["--train-tokens", str(args.stop_tokens)]
    return values


def _checkpoint_args(args: StageArgs) -> list[str]:
    values: list[str] = []
    if args.save_dir is not None:
        # Megatron saves when it leaves its loop; the interval (required with --save) is never reached.
        values += ["--save", str(args.save_dir), "--save-interval", str(NEVER)]
    if args.load is not None:
        values += ["--load", str(args.load.directory), "--load-tag", args.load.tag]
        if args.load.universal:
            values.append("--universal-checkpoint")
    if args.skip_train:
        values.append("--skip-train")
    return values


def _logging_args(training: TrainingConfig, args: StageArgs) -> list[str]:
    values = [
        "--log-interval", str(training.logging.log_interval),
        "--eval-interval", str(training.logging.eval_interval),
        "--eval-iters", str(args.eval_iters or training.logging.eval_iters),
    ]  # fmt: skip
    if training.logging.tensorboard_dir is not None:
        values += [
            "--tensorboard-dir", str(Path(training.logging.tensorboard_dir) / args.run_name),
            "--log-validation-ppl-to-tensorboard",
        ]  # fmt: skip
    if training.logging.wandb_project is not None and training.logging.wandb_mode != "disabled":
        values += ["--wandb-project", training.logging.wandb_project, "--wandb-exp-name", args.run_name]
        if training.logging.wandb_dir is not None:
            values += ["--wandb-save-dir", str(training.logging.wandb_dir)]
    return values


def _runtime_args(training: TrainingConfig, strategy: Strategy, args: StageArgs) -> list[str]:
    values = []
    precision = precision_of(training, args.device_type)
    if precision != "fp32":
        values.append(f"--{precision}")
    if args.device_type == "cpu":
        values += list(CPU_FUSION_OFF)
    values += [
        "--deepspeed",
        "--deepspeed_config", str(args.ds_config_path),
        "--zero-stage", str(strategy.zero_stage),
    ]  # fmt: skip
    return values


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchPlacement:
    """Where the launcher starts processes: this machine only, or this node of a hostfile's nodes."""

    processes_per_node: int
    master_port: int
    master_addr: str = "127.0.0.1"
    hostfile: Path | None = None
    """Multi-node: the DeepSpeed hostfile; every node runs the same command with its own ``node_rank``."""
    node_rank: int = 0


def launcher_command(
    launcher: Path, placement: LaunchPlacement, script: Path, script_args: list[str]
) -> list[str]:
    """``deepspeed [launcher options] pretrain_gpt.py ARGS``. Multi-node runs use ``--no_ssh``: CONA starts
    every node's runner itself (so every node runs this command with its own ``--node_rank``)."""
    command = [str(launcher)]
    if placement.hostfile is not None:
        command += [
            "--hostfile", str(placement.hostfile),
            "--no_ssh", "--node_rank", str(placement.node_rank),
            "--num_gpus", str(placement.processes_per_node),
        ]  # fmt: skip
    else:
        command += ["--num_gpus", str(placement.processes_per_node)]
    command += ["--master_addr", placement.master_addr, "--master_port", str(placement.master_port)]
    return [*command, str(script), *script_args]
