"""AdamW with decay / no-decay parameter groups, and the token-based learning-rate schedule.

The schedule is a pure function of the tokens consumed so far (not of the iteration), so a stage that
changes the global batch size continues the same curve: 1000 tokens into the run mean the same LR
whether they took 10 steps or 100.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from cona.config import TrainingConfig
from cona.errors import ConfigError


def uses_weight_decay(name: str, param: torch.Tensor) -> bool:
    """Whether AdamW decays this parameter.

    Matrices (ndim >= 2: linear weights, token and position embeddings) decay; vectors (biases and the
    weights of LayerNorm/RMSNorm) and scalars do not, as in GPT-2 and Megatron. The rule looks at the
    global number of dimensions (a DTensor shard reports its global ndim), so it gives the same groups
    under every parallel layout; the ``.bias`` name check only guards against a bias stored as a matrix.
    """
    return param.ndim >= 2 and not name.endswith(".bias")


def parameter_groups(model_parts: list[nn.Module]) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(decay, no_decay) trainable parameters of all parts, each parameter once (tied ones included)."""
    seen: set[int] = set()
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for part in model_parts:
        for name, param in part.named_parameters():
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            (decay if uses_weight_decay(name, param) else no_decay).append(param)
    return decay, no_decay


def _implementation_flags(params: list[nn.Parameter]) -> dict[str, bool]:
    """``fused`` when every parameter is a plain CUDA tensor (the fused kernel's requirement), else
    ``foreach`` (which handles DTensor shards of FSDP2/TP and CPU tensors)."""
    plain_cuda = all(p.is_cuda and not isinstance(p, DTensor) for p in params)
    if params and plain_cuda:
        return {"fused": True}
    return {"foreach": True}


def _mesh_key(param: nn.Parameter) -> DeviceMesh | None:
    return param.device_mesh if isinstance(param, DTensor) else None


def _split_by_mesh(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """Split a list so that each part holds only plain tensors or only DTensors of one device mesh.

    A foreach kernel cannot mix them (under TP alone the norms stay plain tensors while the projections
    are DTensors; under FSDP2 x TP some parameters live on the dp mesh, others on the dp x tp mesh).
    Each part becomes its own parameter group; the flattened checkpoint format stores state per
    parameter, so layouts with different group splits still load each other's checkpoints.
    """
    parts: dict[DeviceMesh | None, list[nn.Parameter]] = {}
    for param in params:
        parts.setdefault(_mesh_key(param), []).append(param)
    return list(parts.values())


def build_optimizer(model_parts: list[nn.Module], training: TrainingConfig) -> torch.optim.Optimizer:
    """AdamW over this rank's model parts; the LR starts at 0 and is set each step with :func:`set_lr`."""
    decay, no_decay = parameter_groups(model_parts)
    if not decay and not no_decay:
        raise ValueError("build_optimizer: the model parts have no trainable parameters")
    groups = [
        {"params": part, "weight_decay": training.optimizer.weight_decay} for part in _split_by_mesh(decay)
    ]
    groups += [{"params": part, "weight_decay": 0.0} for part in _split_by_mesh(no_decay)]
    return torch.optim.AdamW(
        groups,
        lr=0.0,
        betas=(training.optimizer.adam_beta1, training.optimizer.adam_beta2),
        eps=training.optimizer.adam_eps,
        **_implementation_flags(decay + no_decay),
    )


def initialise_state(optimizer: torch.optim.Optimizer) -> None:
    """Give Adam(W) the per-parameter state its first step would create (step 0, zero moments), so that a
    checkpoint can be loaded into it. Left to DCP, ``get_state_dict`` on an optimizer without state runs a
    step on zero gradients instead, which under TP on the CPU costs seconds (every foreach op propagates
    DTensor shardings). Other optimizers, and one that has state, are left as they are."""
    if optimizer.state or not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        return
    for group in optimizer.param_groups:
        # As Adam keeps `step`: on the parameter's device for fused/capturable, else a CPU scalar (float64
        # only under a float64 default dtype and not fused).
        on_device = group["fused"] or group["capturable"]
        wide = torch.get_default_dtype() == torch.float64 and not group["fused"]
        step_dtype = torch.float64 if wide else torch.float32
        moments = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group["amsgrad"] else [])
        for param in group["params"]:
            state = optimizer.state[param]
            device = param.device if on_device else torch.device("cpu")
            state["step"] = torch.zeros((), dtype=step_dtype, device=device)
            for name in moments:
                state[name] = torch.zeros_like(param, memory_format=torch.preserve_format)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set the learning rate of every parameter group."""
    for group in optimizer.param_groups:
        group["lr"] = lr


@dataclass(frozen=True, kw_only=True)
class LRSchedule:
    """Linear warmup from 0 to ``peak_lr`` over ``warmup_tokens``, then cosine from ``peak_lr`` down to
    ``min_lr`` at ``decay_tokens`` (counted from the start of training, warmup included), then ``min_lr``."""

    peak_lr: float
    min_lr: float
    warmup_tokens: int
    decay_tokens: int

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_lr <= self.peak_lr:
            raise ValueError(f"LRSchedule needs 0 <= min_lr <= peak_lr, got {self.min_lr} and {self.peak_lr}")
        if not 0 <= self.warmup_tokens <= self.decay_tokens:
            raise ValueError(
                f"LRSchedule needs 0 <= warmup_tokens <= decay_tokens, got "
                f"{self.warmup_tokens} and {self.decay_tokens}"
            )

    def lr_at(self, consumed_tokens: int) -> float:
        if consumed_tokens < self.warmup_tokens:
            return self.peak_lr * consumed_tokens / self.warmup_tokens
        if consumed_tokens >= self.decay_tokens:
            return self.min_lr
        progress = (consumed_tokens - self.warmup_tokens) / (self.decay_tokens - self.warmup_tokens)
        return self.min_lr + (self.peak_lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def to_dict(self) -> dict[str, float | int]:
        return {
            "peak_lr": self.peak_lr,
            "min_lr": self.min_lr,
            "warmup_tokens": self.warmup_tokens,
            "decay_tokens": self.decay_tokens,
        }


def lr_schedule(
    training: TrainingConfig, *, planned_tokens: int, lr_factor: float = 1.0, min_lr_factor: float = 1.0
) -> LRSchedule:
    """The schedule of a stage: peak = base_lr * lr_factor, min = base_min_lr * min_lr_factor.

    Warmup is ``lr_warmup_tokens`` or ``lr_warmup_frac * planned_tokens``; the cosine ends at
    ``lr_decay_tokens`` or at ``planned_tokens``. When a small gbs factor pushes the peak below the
    minimum (possible with ``scale_min_lr: false``), the minimum is lowered to the peak so that the LR
    never rises after warmup.
    """
    if planned_tokens <= 0:
        raise ValueError(f"planned_tokens must be positive, got {planned_tokens}")
    if lr_factor <= 0 or min_lr_factor < 0:
        raise ValueError(f"LR factors must be positive, got {lr_factor} and {min_lr_factor}")
    if training.lr.lr_warmup_tokens is not None:
        warmup = training.lr.lr_warmup_tokens
    else:
        warmup = round(training.lr.lr_warmup_frac * planned_tokens)
    decay = training.lr.lr_decay_tokens if training.lr.lr_decay_tokens is not None else planned_tokens
    if decay < warmup:
        source = (
            "training.lr_decay_tokens" if training.lr.lr_decay_tokens is not None else "the planned tokens"
        )
        raise ConfigError(
            f"{source} ({decay}) is shorter than the warmup ({warmup} tokens); lower "
            f"training.lr_warmup_tokens / training.lr_warmup_frac or raise {source}"
        )
    peak = training.lr.base_lr * lr_factor
    minimum = min(training.lr.base_min_lr * min_lr_factor, peak)
    return LRSchedule(peak_lr=peak, min_lr=minimum, warmup_tokens=warmup, decay_tokens=decay)
