"""The training loop of one stage: step, log, evaluate, check the stop rule and switch requests, save.

Everything it needs is built by the worker and passed in a :class:`StageContext`; the loop holds no global
state. Nothing in a step waits for the device (bf16/fp32 with a fused optimizer): the step's scalars stay
device tensors, kept on the device over the log interval and read once per metrics line, so the host
queues the next step while the device still runs this one. Step timing uses the host clock over each log
interval, read after that one read, which waits for the device. The gradient-noise inputs are measured only
on the last steps before each metrics line and on the steps before the run's first line (:func:`gns_due`);
the line lists each measured step (``gns_steps``) where it has more than one.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from cona.atomic_files import write_json_atomic
from cona.data.gpt_dataset import GPTDataset, collate, micro_batch_sample_ids
from cona.engine import probe_branch
from cona.engine.checkpoint.periodic import PeriodicSaves
from cona.engine.divergence import DivergenceWatch
from cona.engine.interval_sums import IntervalSums
from cona.engine.metrics import MetricsLogger, model_flops_utilization
from cona.engine.optim import LRSchedule, set_lr
from cona.engine.probe import ProbeBatch
from cona.engine.probe_branch import HeldSteps, ProbeLog
from cona.engine.session import RunnerWatch, leave_orphaned
from cona.engine.spec import RUNNER_PID_ENV, StageSpec
from cona.engine.step_trace import StepTrace
from cona.engine.train_model import PendingStepOutput, TrainingModel
from cona.errors import TrainingDiverged
from cona.metrics_record import MetricsRecord
from cona.planner.efficiency import MIN_SAMPLES
from cona.strategy import Strategy
from cona.switch_request import SwitchRequest

Batch = list[tuple[Tensor, Tensor]]
RUNNER_GONE = "runner_gone"
"""What :func:`step_boundary` says when the runner is gone: every rank then exits at once."""
GNS_MIN_STEPS_PER_LINE = 2
"""Measured steps before each metrics line where the difference estimator needs two consecutive gradients
(one where a step's pieces or micro-batches give the small batches at the same parameters)."""
GNS_STEP_FRACTION = 10
"""Longer log intervals measure one step in this many (more estimates per line, under 1% of step time)."""
GNS_FIRST_STEPS = MIN_SAMPLES
"""The steps before the run's first metrics line are measured, up to this many after the run's first step: the
noise-scale tracker needs this many measurements before online mode can decide anything, and one measured step
per line would take that many lines (64 iterations at a log interval of 8, 800 at 100), where online mode
needs a noise scale within about 50 steps. Each measured step gives one measurement (the line lists them,
``gns_steps``). Where a step runs as pieces only when measured, these steps cost about one more step each,
once per run, and only in the first line, whose rate the online search leaves out anyway (it holds the
start-up). The run's first step stays whole, so that the first line also holds the warm-up of the whole
micro-batch's shape (its CUDA graph, eager kernels' first run): measured from step 1, that warm-up would slow
the second line, which is the first rate the online search takes, to a fraction of the later lines' rate."""


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
    save: Callable[..., Path]
    """Collective checkpoint save of the current state (``save(progress)``, with the probe loss of that
    state); returns the global_step directory."""
    timings: dict[str, float]
    """Unix times of the stage's milestones (the loop adds first_step_done and train_done)."""
    probe_batch: ProbeBatch
    """The fixed batch whose loss verifies a checkpoint across a save and the next load."""
    control_group: dist.ProcessGroup | None = None
    """A gloo group over all ranks for host-side agreement (None: the default group is gloo already)."""
    step_trace: StepTrace | None = None
    """Records the samples and LR of every step when tests switch it on (:mod:`cona.engine.step_trace`)."""
    divergence: DivergenceWatch | None = None
    """Stops a diverging run at a metrics line (:mod:`cona.engine.divergence`); None checks nothing."""
    runner_watch: RunnerWatch | None = field(default_factory=RunnerWatch.from_env)
    """Rank 0's check that the runner still runs (None: no runner started this worker)."""
    periodic: PeriodicSaves | None = None
    """The stage's checkpoints between its start and its end (None: only at the end and on a switch)."""
    probes: ProbeLog = field(default_factory=ProbeLog)
    """Where the stage ended when a paired probe's candidate won (:mod:`cona.engine.probe_branch`)."""


def train_stage(ctx: StageContext, progress: Progress) -> str:
    """Train until the stop rule or a switch request; returns the stop reason (see ``STOP_REASONS``).
    A periodic save still in flight at the end is finished (published) before this returns, and so it is
    when training diverged (every rank stops at the same metrics line); after another exception it is not
    (a rank that failed would never join), and its temporary is never loaded. A stage
    that ends in a state unfit to resume from (:meth:`DivergenceWatch.unfit_to_resume`) raises
    :class:`TrainingDiverged` instead of ending, so that state is never saved as the stage's checkpoint."""
    try:
        reason = _train_steps(ctx, progress)
    except TrainingDiverged as err:  # every rank raises it at the same line: they finish the save together
        _finish_saves_after(ctx.periodic, err)
        raise
    if ctx.periodic is not None:
        ctx.periodic.close()
    unfit = ctx.divergence.unfit_to_resume() if ctx.divergence is not None else None
    if unfit is not None:  # every rank holds the same losses: all stop here
        raise TrainingDiverged(f"training diverged by iteration {progress.iteration}: {unfit}")
    return reason


def _record_switch_in(spec: StageSpec, timings: dict[str, float]) -> None:
    """Keep the start milestones of the stage's first attempt that reached a step (``switch_in.json``):
    what the switch into the stage cost. A relaunch after a stop or a kill leaves them (its start is resume
    downtime, not switch cost), as does a replay of the stage."""
    path = spec.switch_in_path
    if not spec.retraining and not path.exists():
        write_json_atomic(path, timings)


def _finish_saves_after(saves: PeriodicSaves | None, diverged: TrainingDiverged) -> None:
    """Collective: finish the periodic save in flight when training diverged (it holds an earlier state,
    which :mod:`cona.engine.divergence` judged when it started); when that fails, the divergence's
    message says the save was dropped."""
    if saves is None:
        return
    try:
        saves.close()
    except Exception as err:
        raise TrainingDiverged(f"{diverged}; the periodic save in flight was dropped: {err}") from None


def _train_steps(ctx: StageContext, progress: Progress) -> str:
    spec = ctx.spec
    interval = IntervalSums()
    while not stop_rule_met(spec, progress):
        lr = ctx.schedule.lr_at(progress.consumed_tokens)
        measure = gns_due(spec, progress, single_step=ctx.model.measures_noise_in_one_step)
        out, grad_norm, stepped = _step(ctx, progress, lr, measure_gns=measure)
        _advance(progress, spec)
        interval.add(out, grad_norm, stepped, warmed_up=ctx.model.shape_warmup.step_warmed_up)
        if "first_step_done" not in ctx.timings:
            out.loss.item()  # once per stage: the milestone is the first step finished on the device
            ctx.timings["first_step_done"] = time.time()
            interval.first_step_s = time.perf_counter() - interval.started
            if ctx.logger is not None:  # rank 0
                _record_switch_in(spec, ctx.timings)
        boundary = step_boundary(spec.switch_request_path, ctx.control_group, ctx.runner_watch, ctx.periodic)
        switch = boundary.switch
        if switch == RUNNER_GONE:
            runner_pid = int(os.environ.get(RUNNER_PID_ENV, "0") or 0)
            leave_orphaned(runner_pid, f"stopping training at iteration {progress.iteration}")
        ending = switch is not None or stop_rule_met(spec, progress)
        probing = boundary.probe is not None and not ending
        interval = _maybe_log(ctx, progress, interval, lr, force=ending or probing)
        if _periodic_save(ctx.periodic, progress, boundary, ending=ending):
            interval.started = time.perf_counter()  # the save is not step time
        if probing:
            switch = _probe(ctx, progress, boundary.probe)
            interval = IntervalSums()  # the probe is not the stage's step time
        if switch is not None:
            ctx.timings["train_done"] = time.time()
            return switch
    ctx.timings["train_done"] = time.time()
    return "completed"


def _periodic_save(
    saves: PeriodicSaves | None, progress: Progress, boundary: Boundary, *, ending: bool
) -> bool:
    """Publish the save in flight once rank 0 wrote it; start one where due (never at the stage's end,
    which saves anyway). Returns whether this waited for a save."""
    if saves is None:
        return False
    waited = False
    if saves.pending is not None and boundary.pending_written:
        saves.finish()
        waited = True
    if not ending and saves.due(progress.iteration, by_time=boundary.save_due_by_time):
        saves.begin(dataclasses.replace(progress))
        waited = True
    return waited


def stop_rule_met(spec: StageSpec, progress: Progress) -> bool:
    if spec.target_iteration is not None and progress.iteration >= spec.target_iteration:
        return True
    return spec.max_tokens is not None and progress.consumed_tokens >= spec.max_tokens


@dataclass(frozen=True)
class Boundary:
    """What rank 0 saw at a step boundary, which every rank acts on alike."""

    switch: str | None
    """The stop reason a switch request asks for, :data:`RUNNER_GONE`, or None."""
    save_due_by_time: bool = False
    """``save_interval_minutes`` passed since the last periodic save started."""
    pending_written: bool = False
    """The periodic save in flight is written: it can be published without waiting."""
    probe: SwitchRequest | None = None
    """The paired probe the runner asks for (a request with action ``probe``), the same on every rank."""


def step_boundary(
    request_path: Path,
    group: dist.ProcessGroup | None,
    runner_watch: RunnerWatch | None = None,
    periodic: PeriodicSaves | None = None,
) -> Boundary:
    """The stop reason a switch request asks for (``switch_requested``, or ``switch_in_place`` when the
    request says ``"in_place": true``), :data:`RUNNER_GONE` when rank 0's ``runner_watch`` found the runner
    gone, or None; and rank 0's view of the periodic saves. Rank 0 reads the request file and its clock;
    one broadcast makes every rank agree on what it saw. The flags travel through a gloo group as a CPU
    tensor, so the check never waits for the GPU."""
    code, by_time, written, request = 0, False, False, None
    if dist.get_rank() == 0:
        if runner_watch is not None and runner_watch.runner_gone():
            code = 3
        elif request_path.exists():
            request = SwitchRequest.read(request_path)  # unreadable: the safe way, through a checkpoint
            code = 1 if request is None else 4 if request.action == "probe" else 2 if request.in_place else 1
        if periodic is not None:
            by_time, written = periodic.due_by_time(), periodic.pending_written()
    flags = torch.tensor([code, int(by_time), int(written)], dtype=torch.int32)
    dist.broadcast(flags, src=0, group=group)
    code, by_time, written = (int(value) for value in flags.tolist())
    probe = None
    if code == 4:  # the request's numbers, as rank 0 read them
        shared = [request if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(shared, src=0, group=group)
        probe = shared[0]
    switch = {0: None, 1: "switch_requested", 2: "switch_in_place", 3: RUNNER_GONE, 4: None}[code]
    return Boundary(switch=switch, save_due_by_time=bool(by_time), pending_written=bool(written), probe=probe)


def _probe(ctx: StageContext, progress: Progress, asked: SwitchRequest) -> str | None:
    """Run the paired probe the runner asked for at this boundary (:mod:`cona.engine.probe_branch`); returns
    ``switch_in_place`` when the candidate won (the stage ends where the probe began; the next stage, the
    candidate's, starts with the branch's samples trained), else None (the stage goes on from the current
    branch). The winner's steps join the step trace, the loser's do not: they are the same samples."""
    spec, rank0 = ctx.spec, dist.get_rank() == 0
    request = probe_branch.request_from(asked, spec)
    refused = probe_branch.refusal(spec, progress, request)
    if refused is not None:
        if rank0:
            record = {"stage": spec.stage, "iteration": progress.iteration, "skipped": refused}
            probe_branch.write_outcome(spec, record, request_done=True)
        return None
    held: dict[int, HeldSteps] = {}  # per branch (its own progress object): the current's first

    def step(strategy: Strategy, schedule: LRSchedule, branch: Progress) -> Tensor:
        trace = held.setdefault(id(branch), HeldSteps())
        lr = schedule.lr_at(branch.consumed_tokens)
        out, _, _ = _step(ctx, branch, lr, measure_gns=False, strategy=strategy, trace=trace)
        _advance(branch, spec, strategy)
        return out.loss

    def evaluate() -> float:  # the probe set: the stage's fixed evaluation samples
        return ctx.model.eval_loss(regrouped_eval_batches(ctx.eval_batches, ctx.model.strategy.mbs))

    stage_start = dataclasses.replace(progress)
    outcome, after = probe_branch.run_probe(
        ctx.model, ctx.optimizer, progress, stage=spec.stage, current=spec.strategy,
        current_schedule=ctx.schedule, request=request, step=step, evaluate=evaluate,
        group=ctx.control_group,
    )  # fmt: skip
    vars(progress).update(vars(after))
    traces = list(held.values())
    if ctx.step_trace is not None:
        for record in traces[0 if outcome.winner == "current" else -1].records:
            ctx.step_trace.record(**record)
    won = outcome.winner == "candidate"
    if rank0:
        probe_branch.write_outcome(spec, outcome.to_dict(), request_done=not won)
    if not won:
        return None
    ctx.probes.stage_end = stage_start
    return "switch_in_place"


def gns_due(spec: StageSpec, progress: Progress, *, single_step: bool = False) -> bool:
    """Whether the coming step comes before the run's first metrics line (its first step apart, at most
    :data:`GNS_FIRST_STEPS` of them) or is one of the last steps before a planned metrics line (log, eval,
    end). ``single_step``: one measured step gives an estimate (see :func:`gns_steps_per_line`).

    A line forced early by a switch request may fall before them; its GNS inputs are then NaN.
    """
    upcoming = progress.iteration + 1  # the iteration number the step ends at
    log_interval = spec.config.training.logging.log_interval
    if 1 < upcoming <= min(GNS_FIRST_STEPS + 1, log_interval, spec.resolved_eval_interval()):
        return True
    steps = gns_steps_per_line(log_interval, single_step=single_step)
    if any((-upcoming) % interval < steps for interval in (log_interval, spec.resolved_eval_interval())):
        return True
    if spec.target_iteration is not None and spec.target_iteration - upcoming < steps:
        return True
    tokens_per_step = spec.strategy.gbs * spec.config.model.seq
    return (
        spec.max_tokens is not None and spec.max_tokens - progress.consumed_tokens <= steps * tokens_per_step
    )


def gns_steps_per_line(log_interval: int, *, single_step: bool = False) -> int:
    """How many steps before each metrics line measure the gradient-noise inputs: one in
    :data:`GNS_STEP_FRACTION`, at least the steps one estimate needs (a measured step costs more than
    another where it runs as pieces, so no more are measured than that)."""
    return max(1 if single_step else GNS_MIN_STEPS_PER_LINE, log_interval // GNS_STEP_FRACTION)


def _step(
    ctx: StageContext,
    progress: Progress,
    lr: float,
    *,
    measure_gns: bool,
    strategy: Strategy | None = None,
    trace: HeldSteps | None = None,
) -> tuple[PendingStepOutput, Tensor, Tensor]:
    """One step from ``progress`` at ``strategy`` (default the stage's: a probe's branch gives its own),
    recorded in ``trace`` (default the stage's step trace)."""
    spec = ctx.spec
    strategy = strategy or spec.strategy
    trace = trace if trace is not None else ctx.step_trace
    sample_ids = micro_batch_sample_ids(
        progress.consumed_samples, strategy.gbs, strategy.mbs, strategy.dp, ctx.dp_rank
    )
    micro_batches = [collate(ctx.train_data, ids) for ids in sample_ids]  # the model moves them to its device
    if ctx.model.device.type == "cuda":  # pinned: the non-blocking copy then never makes the host wait
        micro_batches = [(inputs.pin_memory(), targets.pin_memory()) for inputs, targets in micro_batches]
    set_lr(ctx.optimizer, lr)
    out = ctx.model.train_step_pending(  # also seeds dropout
        micro_batches, iteration=progress.iteration, measure_gns=measure_gns
    )
    grad_norm = ctx.model.clip_grad_norm_pending(spec.config.training.optimizer.clip_grad)
    stepped = ctx.model.optimizer_step_pending(ctx.optimizer)  # which also drops the gradients
    if trace is not None:
        lrs = [group["lr"] for group in ctx.optimizer.param_groups]
        trace.record(iteration=progress.iteration + 1, micro_batches=sample_ids, lrs=lrs)
    return out, grad_norm, stepped


def _advance(progress: Progress, spec: StageSpec, strategy: Strategy | None = None) -> None:
    gbs = (strategy or spec.strategy).gbs
    progress.iteration += 1
    progress.consumed_samples += gbs
    progress.consumed_tokens += gbs * spec.config.model.seq


def _maybe_log(
    ctx: StageContext, progress: Progress, interval: IntervalSums, lr: float, *, force: bool
) -> IntervalSums:
    """Write a metrics line at log and eval boundaries (and at the end); returns the next interval."""
    spec = ctx.spec
    log_due = progress.iteration % spec.config.training.logging.log_interval == 0
    eval_due = progress.iteration % spec.resolved_eval_interval() == 0
    if not (log_due or eval_due or force):
        return interval
    means = interval.means()  # waits for the device: the elapsed time then covers the interval's steps
    elapsed = time.perf_counter() - interval.started
    record = _record(ctx, progress, interval, means, lr, elapsed)
    if eval_due:  # BERT's eval_ppl is over the masked tokens only
        eval_loss = ctx.model.eval_loss(ctx.eval_batches)
        record = record.with_evaluation(eval_loss, masked_tokens=spec.config.model.family == "bert")
    if ctx.logger is not None:
        ctx.logger.write(record.to_dict())
    if ctx.divergence is not None:  # after the line is written: the run's last line shows why it stopped
        steps, skipped = interval.steps, means["skipped_steps"]
        ctx.divergence.check(iteration=progress.iteration, loss=means["loss"], steps=steps, skipped=skipped)
    return IntervalSums()  # starts its clock now: evaluation and logging are not step time


def _record(
    ctx: StageContext,
    progress: Progress,
    interval: IntervalSums,
    means: dict[str, float],
    lr: float,
    elapsed: float,
) -> MetricsRecord:
    spec = ctx.spec
    strategy = spec.strategy
    step_time = elapsed / interval.steps
    tokens_per_s = strategy.gbs * spec.config.model.seq / step_time
    last = interval.last
    assert last is not None  # a log boundary always follows at least one step
    return MetricsRecord(
        stage=spec.stage,
        iteration=progress.iteration,
        consumed_samples=progress.consumed_samples,
        consumed_tokens=progress.consumed_tokens,
        loss=means["loss"],
        lr=lr,
        gbs=strategy.gbs,
        mbs=strategy.mbs,
        dp=strategy.dp,
        tp=strategy.tp,
        pp=strategy.pp,
        step_time_s=step_time,
        tokens_per_s=tokens_per_s,
        mfu=model_flops_utilization(
            tokens_per_s, ctx.flops_per_token, ctx.peak_flops_per_device, strategy.world_size
        ),
        grad_norm=means["grad_norm"],
        gns_small_sqr=means["gns_small_sqr"],
        gns_big_sqr=means["gns_big_sqr"],
        gns_small_batch=last.gns_small_batch,
        gns_big_batch=last.gns_big_batch,
        gns_steps=means["gns_steps"] if len(means["gns_steps"]) > 1 else None,
        steps_in_interval=interval.steps,
        first_step_s=interval.first_step_s,
        warmup_steps=interval.warmup_steps or None,
        skipped_steps=means["skipped_steps"],
        time=time.time(),
    )


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


def regrouped_eval_batches(batches: Batch, mbs: int) -> Batch:
    """The same evaluation samples, in the same order, in micro-batches of ``mbs`` rows: after an in-place
    switch the evaluation runs at the new micro-batch size, as a new stage's would (the first stage's small
    micro-batches would keep the evaluation as slow as at the start). The loss is a mean over
    the loss tokens, whatever the grouping. Unchanged where the rows do not divide into ``mbs``."""
    rows = sum(batch[0].shape[0] for batch in batches)
    if rows % mbs or batches[0][0].shape[0] == mbs:
        return batches
    inputs = torch.cat([batch[0] for batch in batches])
    targets = torch.cat([batch[1] for batch in batches])
    return list(zip(inputs.split(mbs), targets.split(mbs), strict=True))


def _to_device(batch: tuple[Tensor, Tensor], device: torch.device) -> tuple[Tensor, Tensor]:
    inputs, targets = batch
    return inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
