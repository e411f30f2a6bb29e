"""The paired probe in the workers: the next samples trained twice from one state kept on the device.

At a step boundary the parameters, the optimizer's state, the loss scale and the data position are copied on
the device (:class:`BranchState`). The current branch trains the next ``samples`` samples at the current
global batch and evaluates the probe set; the start state is restored exactly; the candidate branch trains
the same samples in the same order (the sampler is keyed on consumed samples,
:func:`cona.data.gpt_dataset.micro_batch_sample_ids`) at the candidate's gbs, mbs and LR, and evaluates the
same probe set. The run continues from the branch :func:`cona.planner.probe_rule.judge` prefers: the
candidate's state stays, or the current branch's end state (copied before the restore) comes back. Either
way the data position is the start plus ``samples``: the loser's samples are the winner's, so each sample is
trained once in the run's history, and the loser's steps are time the run spent.

The branches' steps measure no gradient noise (a probe's two branches must do the same work), and their
timing syncs with the device only where a step warmed up a new shape (the clock restarts there) and at the
branch's end. Every rank judges rank 0's numbers (:func:`rank0_runs`): the losses agree across ranks, the
clocks do not, and ranks that picked different winners would part ways.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from cona import run_files
from cona.engine.gns import local_tensor
from cona.engine.optim import LRSchedule, lr_schedule
from cona.engine.spec import StageSpec
from cona.engine.train_model import TrainingModel
from cona.planner.probe_rule import BranchRun, ProbeOutcome, judge, probe_samples
from cona.strategy import Strategy
from cona.switch_request import SwitchRequest

StepFn = Callable[[Strategy, LRSchedule, Any], torch.Tensor]
"""One training step at a strategy and LR schedule from the progress given, which it advances; returns the
step's loss as a device tensor."""


@dataclass(frozen=True, kw_only=True)
class ProbeRequest:
    """What a probe compares (from a :class:`cona.switch_request.SwitchRequest` of action ``probe``)."""

    candidate: Strategy
    lr_schedule: LRSchedule
    """The candidate's LR schedule (its LR rule at its gbs, as the stage it would become would use)."""
    samples: int
    """Samples each branch trains, before rounding up to whole steps of both batches."""
    tolerance: float
    """Probe-loss difference (nats) within which the branches count as equal."""


def request_from(asked: SwitchRequest, spec: StageSpec) -> ProbeRequest:
    """The probe a request asks for, its candidate's LR schedule built as its stage's would be."""
    assert asked.probe is not None and asked.strategy is not None  # a probe request has both
    schedule = lr_schedule(
        spec.config.training,
        planned_tokens=spec.planned_tokens,
        lr_factor=asked.probe.lr_factor,
        min_lr_factor=asked.probe.min_lr_factor,
    )
    return ProbeRequest(
        candidate=asked.strategy,
        lr_schedule=schedule,
        samples=asked.probe.samples,
        tolerance=asked.probe.tolerance,
    )


def refusal(spec: StageSpec, progress: Any, request: ProbeRequest) -> str | None:
    """Why the probe cannot run here (None: it can): it keeps the layout, and both branches end within the
    stage's stop rule."""
    current, candidate = spec.strategy, request.candidate
    if not current.same_layout(candidate):
        return f"the candidate {candidate.short()} changes the layout of {current.short()}"
    samples = probe_samples(request.samples, current.gbs, candidate.gbs)
    steps = samples // min(current.gbs, candidate.gbs)
    if spec.target_iteration is not None and progress.iteration + steps > spec.target_iteration:
        return f"{steps} probe steps would pass the stage's last iteration {spec.target_iteration}"
    tokens = progress.consumed_tokens + samples * spec.config.model.seq
    if spec.max_tokens is not None and tokens > spec.max_tokens:
        return f"{samples} probe samples would pass the stage's token budget {spec.max_tokens}"
    return None


def write_outcome(spec: StageSpec, record: dict[str, Any], *, request_done: bool) -> None:
    """Rank 0: append the probe's record to ``probes.jsonl``; where the run goes on in this stage, remove
    the probe's request first (the runner then decides again once it reads the record), never a request
    written since (a stop at the run's target)."""
    request = SwitchRequest.read(spec.switch_request_path) if request_done else None
    if request is not None and request.action == "probe":
        spec.switch_request_path.unlink(missing_ok=True)
    with open(run_files.probes_path(spec.run_dir), "a") as handle:
        handle.write(json.dumps(record) + "\n")


@dataclass
class HeldSteps:
    """A branch's step-trace records, kept until the probe knows whether its steps are the run's."""

    records: list[dict[str, Any]] = field(default_factory=list)

    def record(self, **fields: Any) -> None:
        self.records.append(fields)


@dataclass
class ProbeLog:
    """What the stage's probes left: where the stage ended when a candidate branch won (the next stage's
    first samples, already trained under its strategy, are the branch's), else None."""

    stage_end: Any = None


@dataclass(kw_only=True)
class BranchState:
    """A copy, on the device, of what training changes: parameters, optimizer state, loss scale, position."""

    params: list[torch.Tensor]
    optimizer: list[dict[str, Any]]
    loss_scale: dict[str, Any]
    progress: Any


def snapshot(model: TrainingModel, optimizer: torch.optim.Optimizer, progress: Any) -> BranchState:
    """Copy this rank's parameter shards and optimizer state (device memory: about three times the shards)."""
    params = _params(model)
    return BranchState(
        params=[local_tensor(p).detach().clone() for p in params],
        optimizer=[_copy_state(optimizer.state.get(p, {})) for p in params],
        loss_scale=copy.copy(vars(model.scaler)),
        progress=copy.copy(progress),
    )


def restore(model: TrainingModel, optimizer: torch.optim.Optimizer, state: BranchState) -> Any:
    """Put ``state`` back (its tensors move into the model and optimizer: use a snapshot once); returns its
    progress."""
    params = _params(model)
    with torch.no_grad():
        for param, saved, moments in zip(params, state.params, state.optimizer, strict=True):
            local_tensor(param).copy_(saved)
            if moments:
                optimizer.state[param] = moments
            else:
                optimizer.state.pop(param, None)
    vars(model.scaler).update(state.loss_scale)
    return copy.copy(state.progress)


def _params(model: TrainingModel) -> list[torch.nn.Parameter]:
    """Every parameter of this rank's parts once (the optimizer's keys)."""
    unique = {id(p): p for part in model.model_parts for p in part.parameters()}
    return list(unique.values())


def _copy_state(state: dict[str, Any]) -> dict[str, Any]:
    return {
        key: value.clone() if torch.is_tensor(value) else copy.copy(value) for key, value in state.items()
    }


def run_probe(
    model: TrainingModel,
    optimizer: torch.optim.Optimizer,
    progress: Any,
    *,
    stage: int,
    current: Strategy,
    current_schedule: LRSchedule,
    request: ProbeRequest,
    step: StepFn,
    evaluate: Callable[[], float],
    group: dist.ProcessGroup | None = None,
) -> tuple[ProbeOutcome, Any]:
    """Run both branches and continue from the winner; returns the outcome and the progress to go on from
    (the start plus the probe's samples). The model ends under the winner's strategy. ``group``: the one
    rank 0's branch numbers travel through (:func:`rank0_runs`; None: the default group)."""
    began = time.perf_counter()
    samples = probe_samples(request.samples, current.gbs, request.candidate.gbs)
    start_loss = evaluate()
    start = snapshot(model, optimizer, progress)
    current_run = _branch(model, progress, current, current_schedule, samples, step, evaluate)
    current_end = snapshot(model, optimizer, progress)
    progress = restore(model, optimizer, start)
    model.rebatch(request.candidate)
    candidate_run = _branch(model, progress, request.candidate, request.lr_schedule, samples, step, evaluate)
    current_run, candidate_run = rank0_runs(current_run, candidate_run, group)
    winner, reason = judge(
        start_loss=start_loss, current=current_run, candidate=candidate_run, tolerance=request.tolerance
    )
    if winner == "current":
        model.rebatch(current)
        progress = restore(model, optimizer, current_end)
    outcome = ProbeOutcome(
        stage=stage,
        iteration=start.progress.iteration,
        consumed_samples=start.progress.consumed_samples,
        samples=samples,
        tokens=progress.consumed_tokens - start.progress.consumed_tokens,
        start_loss=start_loss,
        current=current_run,
        candidate=candidate_run,
        tolerance=request.tolerance,
        winner=winner,
        reason=reason,
        wall_s=time.perf_counter() - began,
    )
    return outcome, progress


def rank0_runs(
    current: BranchRun, candidate: BranchRun, group: dist.ProcessGroup | None = None
) -> tuple[BranchRun, BranchRun]:
    """Both branches as rank 0 measured them, on every rank. The losses are the same everywhere, but each
    rank times the branches on its own clock: judged on different seconds, a close probe can be won by the
    candidate on one rank and by the current batch on another, and the ranks part ways (one ends the stage,
    another trains on) until a collective hangs."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return current, candidate
    runs = (current, candidate) if dist.get_rank() == 0 else None
    shared: list[tuple[BranchRun, BranchRun] | None] = [runs]
    dist.broadcast_object_list(shared, src=0, group=group)
    assert shared[0] is not None
    return shared[0]


def _branch(
    model: TrainingModel,
    progress: Any,
    strategy: Strategy,
    schedule: LRSchedule,
    samples: int,
    step: StepFn,
    evaluate: Callable[[], float],
) -> BranchRun:
    """Train ``samples`` samples at ``strategy`` from ``progress`` (advanced in place) and evaluate."""
    steps = samples // strategy.gbs
    lr = schedule.lr_at(progress.consumed_tokens)
    losses: list[torch.Tensor] = []
    began = steady_from = time.perf_counter()
    steady_steps = 0
    for _ in range(steps):
        losses.append(step(strategy, schedule, progress))
        steady_steps += 1
        if model.shape_warmup.step_warmed_up:  # a new shape: its warm-up is start-up, not the rate
            losses[-1].item()
            steady_from, steady_steps = time.perf_counter(), 0
    train_loss = float(torch.stack(losses).float().mean().item())  # waits for the device
    ended = time.perf_counter()
    seconds = ended - began
    steady = (ended - steady_from) * steps / steady_steps if steady_steps else seconds
    return BranchRun(
        gbs=strategy.gbs,
        mbs=strategy.mbs,
        lr=lr,
        steps=steps,
        loss=evaluate(),
        train_loss=train_loss,
        seconds=seconds,
        steady_seconds=steady,
    )
