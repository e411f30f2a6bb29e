"""The training loop of one stage: step, log, evaluate, check the stop rule and switch requests, save.

Everything it needs is built by the worker and passed in a :class:`StageContext`; the loop holds no global
state. Step timing uses the host clock over each log interval: ``train_step`` returns the loss as a Python
float, which already waits for the device, so no extra synchronisation is added.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from cona.data.gpt_dataset import GPTDataset, collate, micro_batch_sample_ids
from cona.engine.metrics import MetricsLogger, model_flops_utilization
from cona.engine.optim import LRSchedule, set_lr
from cona.engine.spec import StageSpec
from cona.engine.train_model import StepOutput, TrainingModel

Batch = list[tuple[Tensor, Tensor]]


@dataclass(kw_only=True)
class Progress:
    """Where the run stands; saved in every checkpoint's trainer_state."""

    iteration: int = 0
    consumed_samples: int = 0
    consumed_tokens: int = 0

    @classmethod
    def from_trainer_state(cls, state: dict[str, Any]) -> Progress:
        return cls(
            iteration=int(state["iteration"]),
            consumed_samples=int(state["consumed_samples"]),
            consumed_tokens=int(state["consumed_tokens"]),
        )


@dataclass(frozen=True, kw_only=True)
class StageContext:
    """What the loop works with, built once by the worker."""

    spec: StageSpec
    model: TrainingModel
    optimizer: torch.optim.Optimizer
    schedule: LRSchedule
    train_data: GPTDataset
    eval_batches: Batch
    """This dp rank's share of the fixed validation set (see :func:`fixed_eval_batches`)."""
    dp_rank: int
    flops_per_token: float
    peak_flops_per_device: float | None
    logger: MetricsLogger | None
    """Rank 0 only."""
    save: Callable[[Progress], Path]
    """Collective checkpoint save of the current state; returns the global_step directory."""
    timings: dict[str, float]
    """Unix times of the stage's milestones (the loop adds first_step_done and train_done)."""
    control_group: dist.ProcessGroup | None = None
    """A gloo group over all ranks for host-side agreement (None: the default group is gloo already)."""


@dataclass(kw_only=True)
class _Interval:
    """Sums over the steps since the last metrics line (the line reports their means)."""

    steps: int = 0
    skipped: int = 0
    loss: float = 0.0
    grad_norm: float = 0.0
    gns_small_sqr: float = 0.0
    gns_big_sqr: float = 0.0
    gns_measured: int = 0
    """Steps with finite GNS inputs (the first step of a difference estimate and fp16 overflows have none)."""
    last: StepOutput | None = None
    started: float = field(default_factory=time.perf_counter)

    def add(self, out: StepOutput, grad_norm: float, stepped: bool) -> None:
        self.steps += 1
        self.skipped += 0 if stepped else 1
        self.loss += out.loss
        self.grad_norm += grad_norm
        if math.isfinite(out.gns_small_sqr) and math.isfinite(out.gns_big_sqr):
            self.gns_small_sqr += out.gns_small_sqr
            self.gns_big_sqr += out.gns_big_sqr
            self.gns_measured += 1
        self.last = out

    def gns_means(self) -> tuple[float, float]:
        """Mean small- and big-batch squared norms over the measured steps (NaN if none was measured)."""
        if not self.gns_measured:
            return math.nan, math.nan
        return self.gns_small_sqr / self.gns_measured, self.gns_big_sqr / self.gns_measured


def train_stage(ctx: StageContext, progress: Progress) -> str:
    """Train until the stop rule or a switch request; returns the stop reason (see ``STOP_REASONS``)."""
    spec = ctx.spec
    interval = _Interval()
    while not stop_rule_met(spec, progress):
        lr = ctx.schedule.lr_at(progress.consumed_tokens)
        out, grad_norm, stepped = _step(ctx, progress, lr)
        _advance(progress, spec)
        interval.add(out, grad_norm, stepped)
        if "first_step_done" not in ctx.timings:
            ctx.timings["first_step_done"] = time.time()
        switch = switch_requested(spec.switch_request_path, ctx.control_group)
        ending = switch or stop_rule_met(spec, progress)
        interval = _maybe_log(ctx, progress, interval, lr, force=ending)
        if spec.save_interval and progress.iteration % spec.save_interval == 0 and not ending:
            ctx.save(progress)
            interval.started = time.perf_counter()  # the save is not step time
        if switch:
            ctx.timings["train_done"] = time.time()
            return "switch_requested"
    ctx.timings["train_done"] = time.time()
    return "completed"


def stop_rule_met(spec: StageSpec, progress: Progress) -> bool:
    if spec.target_iteration is not None and progress.iteration >= spec.target_iteration:
        return True
    return spec.max_tokens is not None and progress.consumed_tokens >= spec.max_tokens


def switch_requested(request_path: Path, group: dist.ProcessGroup | None) -> bool:
    """Rank 0 looks for the request file; one broadcast makes every rank agree on what it saw. The flag
    travels through a gloo group as a CPU tensor, so the check never waits for the GPU."""
    seen = dist.get_rank() == 0 and request_path.exists()
    flag = torch.tensor([1 if seen else 0], dtype=torch.int32)
    dist.broadcast(flag, src=0, group=group)
    return bool(flag.item())


def _step(ctx: StageContext, progress: Progress, lr: float) -> tuple[StepOutput, float, bool]:
    spec = ctx.spec
    strategy = spec.strategy
    sample_ids = micro_batch_sample_ids(
        progress.consumed_samples, strategy.gbs, strategy.mbs, strategy.dp, ctx.dp_rank
    )
    micro_batches = [collate(ctx.train_data, ids) for ids in sample_ids]  # the model moves them to its device
    set_lr(ctx.optimizer, lr)
    out = ctx.model.train_step(micro_batches, iteration=progress.iteration)  # also seeds dropout
    grad_norm = ctx.model.clip_grad_norm_(spec.config.training.clip_grad)
    stepped = ctx.model.optimizer_step(ctx.optimizer)
    ctx.optimizer.zero_grad(set_to_none=True)
    return out, grad_norm, stepped


def _advance(progress: Progress, spec: StageSpec) -> None:
    progress.iteration += 1
    progress.consumed_samples += spec.strategy.gbs
    progress.consumed_tokens += spec.strategy.gbs * spec.config.model.seq


def _maybe_log(
    ctx: StageContext, progress: Progress, interval: _Interval, lr: float, *, force: bool
) -> _Interval:
    """Write a metrics line at log and eval boundaries (and at the end); returns the next interval."""
    spec = ctx.spec
    log_due = progress.iteration % spec.config.training.log_interval == 0
    eval_due = progress.iteration % spec.resolved_eval_interval() == 0
    if not (log_due or eval_due or force):
        return interval
    elapsed = time.perf_counter() - interval.started
    record = _record(ctx, progress, interval, lr, elapsed)
    if eval_due:
        eval_loss = ctx.model.eval_loss(ctx.eval_batches)
        record["eval_loss"] = eval_loss
        record["eval_ppl"] = math.exp(eval_loss) if eval_loss < 700 else math.inf
    if ctx.logger is not None:
        ctx.logger.write(record)
    return _Interval()  # starts its clock now: evaluation and logging are not step time


def _record(
    ctx: StageContext, progress: Progress, interval: _Interval, lr: float, elapsed: float
) -> dict[str, Any]:
    spec = ctx.spec
    strategy = spec.strategy
    step_time = elapsed / interval.steps
    tokens_per_s = strategy.gbs * spec.config.model.seq / step_time
    last = interval.last
    assert last is not None  # a log boundary always follows at least one step
    gns_small_sqr, gns_big_sqr = interval.gns_means()
    return {
        "stage": spec.stage,
        "iteration": progress.iteration,
        "consumed_samples": progress.consumed_samples,
        "consumed_tokens": progress.consumed_tokens,
        "loss": interval.loss / interval.steps,
        "lr": lr,
        "gbs": strategy.gbs,
        "mbs": strategy.mbs,
        "dp": strategy.dp,
        "tp": strategy.tp,
        "pp": strategy.pp,
        "step_time_s": step_time,
        "tokens_per_s": tokens_per_s,
        "mfu": model_flops_utilization(
            tokens_per_s, ctx.flops_per_token, ctx.peak_flops_per_device, strategy.world_size
        ),
        "grad_norm": interval.grad_norm / interval.steps,
        "gns_small_sqr": gns_small_sqr,
        "gns_big_sqr": gns_big_sqr,
        "gns_small_batch": last.gns_small_batch,
        "gns_big_batch": last.gns_big_batch,
        "steps_in_interval": interval.steps,
        "skipped_steps": interval.skipped,
        "time": time.time(),
    }


def fixed_eval_batches(
    valid_data: GPTDataset, *, samples: int, mbs: int, dp: int, dp_rank: int, device: torch.device
) -> Batch:
    """This dp rank's micro-batches of the first ``samples`` validation samples, moved to ``device`` once.

    The set does not depend on the current gbs, so eval numbers compare across stages; only its rounding
    down to whole rounds of ``mbs * dp`` samples depends on the layout.
    """
    micro_batches = max(samples // (mbs * dp), 1)
    ids = micro_batch_sample_ids(0, micro_batches * mbs * dp, mbs, dp, dp_rank)
    return [_to_device(collate(valid_data, np.asarray(batch)), device) for batch in ids]


def _to_device(batch: tuple[Tensor, Tensor], device: torch.device) -> tuple[Tensor, Tensor]:
    inputs, targets = batch
    return inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
