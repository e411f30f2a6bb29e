"""Building one stage's objects in a worker: from scratch or a checkpoint (:func:`build_stage`), or by
taking over the state the session's previous stage left in memory (:func:`continue_in_place`).

An in-place switch changes only what does not touch the layout (gbs, mbs and with them the LR factor): the
model, its sharding, the optimizer state, the data and the compiled graphs stay, so the switch costs no
checkpoint round trip. The samples continue exactly where the previous stage stopped, as they would after a
save and a load (the sampler's window depends only on the consumed samples and the new gbs).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import IO

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from cona.config import ConaConfig
from cona.data.gpt_dataset import build_datasets
from cona.engine.checkpoint.info import PROBE_FILE, read_checkpoint_info, resolve_checkpoint
from cona.engine.checkpoint.load import load_checkpoint
from cona.engine.checkpoint.paths import RUN_KEY, layout_dir, tmp_owner
from cona.engine.checkpoint.periodic import PERIODIC_KEY, PeriodicSaves
from cona.engine.checkpoint.save import PendingSave, start_checkpoint
from cona.engine.divergence import DivergenceWatch
from cona.engine.metrics import MetricsLogger, build_metrics_logger, peak_flops
from cona.engine.optim import LRSchedule, build_optimizer, lr_schedule
from cona.engine.parallel_dims import build_mesh
from cona.engine.probe import ProbeBatch, measure_probe, probe_batch
from cona.engine.probe_branch import ProbeLog
from cona.engine.spec import StageSpec
from cona.engine.step_modes import resolved_dtype
from cona.engine.step_trace import step_trace_from_env
from cona.engine.switch_check import ProbeRecord, Verdict, compare_probe, write_verdict
from cona.engine.train_model import TrainingModel, build_training_model
from cona.engine.trainer import Progress, StageContext, fixed_eval_batches, regrouped_eval_batches
from cona.errors import CheckpointError, LaunchError
from cona.planner.flops import training_flops_per_token


@dataclass(frozen=True, kw_only=True)
class InPlaceState:
    """What a stage that ended on an in-place switch hands to the session's next stage."""

    context: StageContext
    progress: Progress
    """Where the state stands (ahead of ``stage_end`` by a probe's candidate branch, whose samples are the
    next stage's first)."""
    stage_end: Progress | None = None
    """Where the stage ended, the next one's start (None: at ``progress``)."""


def continue_in_place(
    carried: InPlaceState | None, spec: StageSpec, *, console: IO[str] | None, timings: dict[str, float]
) -> tuple[StageContext, Progress]:
    """The previous stage's objects under ``spec``'s gbs, mbs and LR factors (same layout and config). The
    evaluation keeps its samples, regrouped at the new mbs (it runs eager: no shape is compiled for it)."""
    if carried is None:
        raise LaunchError(f"stage {spec.stage}: continue_in_place, but no earlier stage's state is in memory")
    old = carried.context
    progress = dataclasses.replace(carried.progress)
    ended = (carried.stage_end or progress).iteration
    if ended != spec.start_iteration:
        raise LaunchError(
            f"stage {spec.stage}: the stage in memory ended at iteration {ended}, this stage starts "
            f"at {spec.start_iteration}"
        )
    if spec.config.to_dict() != old.spec.config.to_dict():
        raise LaunchError(
            f"stage {spec.stage}: an in-place switch keeps the config of stage {old.spec.stage}"
        )
    model, strategy = old.model, spec.strategy
    model.rebatch(strategy)  # refuses a layout change
    schedule = lr_schedule(
        spec.config.training,
        planned_tokens=spec.planned_tokens,
        lr_factor=spec.lr_factor,
        min_lr_factor=spec.min_lr_factor,
    )
    dtype = resolved_dtype(spec.config.training, model.device)
    root = layout_dir(spec.workdir, spec.config, strategy, dtype, run_name=spec.run_name)
    saving = (spec, model, old.optimizer, schedule, root, old.probe_batch, old.divergence)
    context = dataclasses.replace(
        old,
        spec=spec,
        schedule=schedule,
        eval_batches=regrouped_eval_batches(old.eval_batches, strategy.mbs),
        logger=_rank0_logger(spec, console),
        save=partial(_save, *saving),
        periodic=periodic_saves(spec, partial(_start_save, *saving), root),
        probes=ProbeLog(),
        timings=timings,
        step_trace=step_trace_from_env(
            spec.stage_dir, rank=dist.get_rank(), dp_rank=old.dp_rank, stage=spec.stage
        ),
    )
    return context, progress


def drop_in_place_state(carried: InPlaceState) -> None:
    """Leave the mesh groups of a handed-over state the next stage does not take (it builds its own); the
    caller then drops its reference and releases the memory."""
    destroy_mesh_groups(carried.context.model.mesh)


def destroy_mesh_groups(mesh: DeviceMesh) -> None:
    """Leave the mesh's own process groups (never the default one): each holds connections, and on CUDA
    NCCL buffers, that a session would otherwise pile up stage after stage."""
    world = dist.group.WORLD
    for group in {id(group): group for group in mesh.get_all_groups()}.values():
        if group is not world:
            dist.destroy_process_group(group)


def _eval_batches(spec: StageSpec, valid_data, dp_rank: int, device: torch.device):
    return fixed_eval_batches(
        valid_data,
        samples=spec.resolved_eval_iters() * spec.config.training.lr.base_gbs,
        mbs=spec.strategy.mbs,
        dp=spec.strategy.dp,
        dp_rank=dp_rank,
        device=device,
    )


def build_stage(
    spec: StageSpec,
    device: torch.device,
    *,
    control_group: dist.ProcessGroup | None,
    console: IO[str] | None,
    timings: dict[str, float],
) -> tuple[StageContext, Progress]:
    """Mesh, model, optimizer, data and LR schedule of this rank, resumed from ``spec.load_path``."""
    config, strategy = spec.config, spec.strategy
    mesh = build_mesh(strategy, device.type)
    model = build_training_model(config, strategy, mesh, device)
    optimizer = build_optimizer(model.model_parts, config.training)
    timings["model_done"] = time.time()
    splits = _build_datasets(config)
    timings["data_done"] = time.time()
    progress, state = Progress(), None
    if spec.load_path is not None:
        state = load_checkpoint(
            spec.load_path, model_parts=model.model_parts, optimizer=optimizer, config=config
        )
        progress = Progress.from_trainer_state(state)
    divergence = DivergenceWatch.from_config(config, state)
    schedule = lr_schedule(
        config.training,
        planned_tokens=spec.planned_tokens,
        lr_factor=spec.lr_factor,
        min_lr_factor=spec.min_lr_factor,
    )
    dp_rank = mesh["dp"].get_local_rank()
    dtype = resolved_dtype(config.training, device)
    probe = probe_batch(splits)
    root = layout_dir(spec.workdir, config, strategy, dtype, run_name=spec.run_name)
    saving = (spec, model, optimizer, schedule, root, probe, divergence)
    context = StageContext(
        spec=spec,
        model=model,
        optimizer=optimizer,
        schedule=schedule,
        train_data=splits.train,
        eval_batches=_eval_batches(spec, splits.valid, dp_rank, device),
        dp_rank=dp_rank,
        flops_per_token=training_flops_per_token(config.model),
        peak_flops_per_device=peak_flops(_device_name(device), dtype),
        logger=_rank0_logger(spec, console),
        save=partial(_save, *saving),
        periodic=periodic_saves(spec, partial(_start_save, *saving), root),
        probes=ProbeLog(),
        probe_batch=probe,
        timings=timings,
        control_group=control_group,
        step_trace=step_trace_from_env(
            spec.stage_dir, rank=dist.get_rank(), dp_rank=dp_rank, stage=spec.stage
        ),
        divergence=divergence,
    )
    return context, progress


def _start_save(
    spec: StageSpec,
    model: TrainingModel,
    optimizer: torch.optim.Optimizer,
    schedule: LRSchedule,
    checkpoint_root: Path,
    probe: ProbeBatch,
    divergence: DivergenceWatch | None,
    at: Progress,
    *,
    milestones: dict[str, float] | None = None,
    writer_group: dist.ProcessGroup | None = None,
) -> PendingSave:
    """Collective: start saving the stage's state at ``at`` (``trainer_state``: the progress counters
    :meth:`Progress.from_trainer_state` reads back, the stage, the run, the seed and the LR schedule), with
    the probe loss of the state saved, which whoever loads it verifies (any later stage may load it under
    another layout). ``writer_group``: a periodic save, written in the background over that group.
    ``milestones`` gets ``probe_done``: the unix time the probe was measured. ``divergence``'s losses go
    into the trainer state; a state it finds unfit to resume from is saved without becoming ``latest``."""
    record = measure_probe(model, probe, iteration=at.iteration)
    if milestones is not None:
        milestones["probe_done"] = time.time()
    owner = tmp_owner(spec.run_dir)
    trainer_state = {
        **dataclasses.asdict(at),
        "stage": spec.stage,
        RUN_KEY: owner,
        PERIODIC_KEY: writer_group is not None,
        "seed": spec.config.training.runtime.seed,
        "lr_schedule": dataclasses.asdict(schedule),
    }
    unfit = divergence.unfit_to_resume() if divergence is not None else None
    if divergence is not None:
        trainer_state |= divergence.trainer_state()
    if unfit is not None and dist.get_rank() == 0:
        print(f"checkpoint at iteration {at.iteration} does not become latest: {unfit}", flush=True)
    return start_checkpoint(
        checkpoint_root,
        iteration=at.iteration,
        model_parts=model.model_parts,
        optimizer=optimizer,
        trainer_state=trainer_state,
        config=spec.config,
        strategy=spec.strategy,
        probe=record.to_dict(),
        owner=owner,
        background=writer_group is not None,
        writer_group=writer_group,
        move_latest=unfit is None,
    )


def _save(*args, **kwargs) -> Path:
    """Collective synchronous save (the stage's last): :func:`_start_save` finished at once."""
    return _start_save(*args, **kwargs).finish()


def periodic_saves(spec: StageSpec, start: Callable[..., PendingSave], root: Path) -> PeriodicSaves | None:
    """The stage's periodic saves (None: neither ``save_interval`` nor ``save_interval_minutes`` is set)."""
    if spec.save_interval is None and spec.save_interval_minutes is None:
        return None
    training = spec.config.training
    return PeriodicSaves(
        every_iterations=spec.save_interval,
        every_seconds=spec.save_interval_minutes * 60.0 if spec.save_interval_minutes is not None else None,
        keep=training.checkpoint.keep_checkpoints,
        start=start,
        layout_dir=root,
        stage=spec.stage,
        owner=tmp_owner(spec.run_dir),
        loaded=spec.load_path,
        timeout_minutes=training.runtime.distributed_timeout_minutes,
    )


def verify_loaded(context: StageContext, load_path: Path, *, iteration: int) -> Verdict:
    """Collective: the probe loss of the weights just loaded against the one saved with them. Rank 0 writes
    the verdict to ``stages/<N>/switch_check.json``; every rank raises :class:`CheckpointError` when the
    two differ by more than float noise (all ranks hold the same all-reduced loss, so all agree)."""
    checkpoint = resolve_checkpoint(load_path)
    saved = read_checkpoint_info(checkpoint).probe
    try:
        before = ProbeRecord.from_dict(saved) if saved is not None else None
    except CheckpointError as err:
        raise CheckpointError(f"{checkpoint / PROBE_FILE}: {err}") from None
    after = measure_probe(context.model, context.probe_batch, iteration=iteration)
    verdict = compare_probe(before, after, checkpoint=str(checkpoint))
    if dist.get_rank() == 0:
        write_verdict(context.spec.stage_dir, verdict)
        print(verdict.message(), flush=True)  # to rank0.log; the runner reports it to the user
    if not verdict.passed:
        raise CheckpointError(verdict.message())
    return verdict


def _rank0_logger(spec: StageSpec, console: IO[str] | None) -> MetricsLogger | None:
    if dist.get_rank() != 0:
        return None
    return build_metrics_logger(
        metrics_path=spec.metrics_path,
        training=spec.config.training,
        run_name=spec.run_dir.name,
        console=console,
    )


def _build_datasets(config: ConaConfig):
    """Rank 0 builds (and caches) the sample indices first, so the other ranks only read the cache."""
    if dist.get_rank() == 0:
        splits = build_datasets(config)
        dist.barrier()
        return splits
    dist.barrier()
    return build_datasets(config)


def _device_name(device: torch.device) -> str | None:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None
