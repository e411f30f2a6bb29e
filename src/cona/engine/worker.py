"""torchrun entry point of one stage: ``python -m cona.engine.worker SPEC.json``.

Reads the stage spec, joins the process group (gloo on CPU, NCCL on CUDA), builds the mesh, model, optimizer
and data, resumes from the spec's checkpoint and verifies it (the probe loss saved with it must come out the
same under this layout, see :mod:`cona.engine.switch_check`), trains (:mod:`cona.engine.trainer`), measures
the probe loss and saves, and writes ``stage_result.json`` (rank 0). Every rank writes its output to
``stages/<N>/rank<r>.log``; rank 0 keeps the original stdout for the console line of each log interval. On an
exception a rank writes ``stages/<N>/rank<r>.error`` (JSON with the traceback) for the runner to show, and
exits 1.

In a session (``python -m cona.engine.worker SPEC --session DIR``, :mod:`cona.runner.worker_session`) the
processes run one stage after another without restarting: they join the process group once, and after
each stage drop its objects, rank 0 writes ``DIR/done-<k>.json``, and every rank waits for the runner's
``DIR/next-<k+1>.json``: ``{"spec": PATH, "written_at": T}`` runs that stage, ``{"stop": true}`` ends the
session. A rank whose runner (``CONA_RUNNER_PID``) or torchrun is gone stops waiting and exits 1.

The process ends with ``os._exit`` after a barrier: interpreter finalisation can abort in gloo's threads
once DTensor collectives ran (see docs: torch-native-on-cpu, gotcha 1).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import sys
import time
import traceback
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import IO, NoReturn

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from cona.config import ConaConfig
from cona.data.gpt_dataset import build_datasets
from cona.engine.checkpoint import (
    PROBE_FILE,
    layout_dir,
    load_checkpoint,
    read_checkpoint_info,
    resolve_checkpoint,
    save_checkpoint,
)
from cona.engine.metrics import MetricsLogger, build_metrics_logger, peak_flops
from cona.engine.optim import LRSchedule, build_optimizer, lr_schedule
from cona.engine.parallel_dims import build_mesh, validate_layout
from cona.engine.probe import ProbeBatch, measure_probe, probe_batch
from cona.engine.session import SESSION_FLAG, next_stage
from cona.engine.spec import LAUNCH_TIME_ENV, WORKER_CONSOLE_ENV, StageResult, StageSpec
from cona.engine.switch_check import ProbeRecord, Verdict, compare_probe, write_verdict
from cona.engine.train_model import TrainingModel, build_training_model, resolved_dtype
from cona.engine.trainer import Progress, StageContext, fixed_eval_batches, train_stage
from cona.errors import CheckpointError
from cona.planner.flops import training_flops_per_token


def main(argv: list[str] | None = None) -> NoReturn:
    process_start = time.time()
    args = sys.argv[1:] if argv is None else argv
    rank = int(os.environ.get("RANK", "0"))
    spec_path = Path(args[0])
    session_dir = Path(args[2]) if len(args) == 3 and args[1] == SESSION_FLAG else None
    echo = rank == 0 and os.environ.get(WORKER_CONSOLE_ENV) != "0"  # else the runner's console shows them
    timings = {
        "launch": float(os.environ.get(LAUNCH_TIME_ENV, process_start)),
        "process_start": process_start,
    }
    console, joined = None, None
    for number in itertools.count(1):
        error_dir = spec_path.parent  # the stage directory, also when the spec itself cannot be read
        try:
            spec = StageSpec.read(spec_path)
            error_dir = spec.stage_dir
            console = console or open_console()
            point_output(spec.stage_dir, rank)
            joined = joined or init_distributed(spec.config)  # once: a session keeps the process group
            run_stage(spec, *joined, console=console if echo else None, timings=timings)
            command = next_stage(spec, session_dir, number, rank) if session_dir else {"stop": True}
        except BaseException as err:  # noqa: BLE001 (every failure must reach the runner as an .error file)
            write_error(error_dir, rank, err)
            _flush()
            os._exit(1)
        if command.get("stop"):
            finish()
        # A reused process starts the stage when it reads the command: its "process start" is that wait.
        spec_path = Path(command["spec"])
        timings = {"launch": float(command["written_at"]), "process_start": time.time()}


def run_stage(
    spec: StageSpec,
    device: torch.device,
    control_group: dist.ProcessGroup | None,
    *,
    console: IO[str] | None,
    timings: dict[str, float],
) -> StageResult:
    """Build, resume, train and save one stage; rank 0 writes ``stage_result.json``. The stage's mesh
    groups are destroyed at the end (a session's next stage builds its own)."""
    context, progress = build_stage(
        spec, device, control_group=control_group, console=console, timings=timings
    )
    verdict = None
    if spec.load_path is not None:
        timings["load_done"] = time.time()
        verdict = verify_loaded(context, spec.load_path, iteration=progress.iteration)
        timings["verify_done"] = time.time()
    timings["setup_done"] = time.time()
    try:
        reason = train_stage(context, progress)
    finally:
        if context.logger is not None:
            context.logger.close()
    saves = reason == "switch_requested" or spec.save_at_end
    checkpoint = context.save(progress, milestones=timings) if saves else None
    timings["save_done"] = time.time()
    result = StageResult(
        stage=spec.stage,
        reason=reason,
        last_iteration=progress.iteration,
        consumed_samples=progress.consumed_samples,
        consumed_tokens=progress.consumed_tokens,
        checkpoint=str(checkpoint) if checkpoint is not None else None,
        timings=timings,
        switch_check=verdict.to_dict() if verdict is not None else None,
    )
    if dist.get_rank() == 0:
        result.write(spec.result_path)
    _destroy_mesh_groups(context.model.mesh)
    return result


def _destroy_mesh_groups(mesh: DeviceMesh) -> None:
    """Leave the mesh's own process groups (never the default one): each holds connections, and on CUDA
    NCCL buffers, that a session would otherwise pile up stage after stage."""
    world = dist.group.WORLD
    for group in {id(group): group for group in mesh.get_all_groups()}.values():
        if group is not world:
            dist.destroy_process_group(group)


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
    validate_layout(config.model, config.training, strategy, world_size=dist.get_world_size())
    mesh = build_mesh(strategy, device.type)
    model = build_training_model(config, strategy, mesh, device)
    optimizer = build_optimizer(model.model_parts, config.training)
    splits = _build_datasets(config)
    progress = Progress()
    if spec.load_path is not None:
        state = load_checkpoint(
            spec.load_path, model_parts=model.model_parts, optimizer=optimizer, config=config
        )
        progress = Progress.from_trainer_state(state)
    schedule = lr_schedule(
        config.training,
        planned_tokens=spec.planned_tokens,
        lr_factor=spec.lr_factor,
        min_lr_factor=spec.min_lr_factor,
    )
    dp_rank = mesh["dp"].get_local_rank()
    eval_samples = spec.resolved_eval_iters() * config.training.base_gbs
    dtype = resolved_dtype(config.training, device)
    probe = probe_batch(splits)
    context = StageContext(
        spec=spec,
        model=model,
        optimizer=optimizer,
        schedule=schedule,
        train_data=splits.train,
        eval_batches=fixed_eval_batches(
            splits.valid,
            samples=eval_samples,
            mbs=strategy.mbs,
            dp=strategy.dp,
            dp_rank=dp_rank,
            device=device,
        ),
        dp_rank=dp_rank,
        flops_per_token=training_flops_per_token(config.model),
        peak_flops_per_device=peak_flops(_device_name(device), dtype),
        logger=_rank0_logger(spec, console),
        save=partial(
            _save, spec, model, optimizer, schedule, layout_dir(spec.workdir, config, strategy, dtype), probe
        ),
        probe_batch=probe,
        timings=timings,
        control_group=control_group,
    )
    return context, progress


def _save(
    spec: StageSpec,
    model: TrainingModel,
    optimizer: torch.optim.Optimizer,
    schedule: LRSchedule,
    checkpoint_root: Path,
    probe: ProbeBatch,
    at: Progress,
    *,
    milestones: dict[str, float] | None = None,
) -> Path:
    """Collective save of the stage's state at ``at`` (trainer_state as the engine contract lists it), with
    the probe loss of the state saved, which whoever loads it verifies (any later stage may load it under
    another layout). ``milestones`` gets ``probe_done``: the unix time the probe was measured."""
    record = measure_probe(model, probe, iteration=at.iteration)
    if milestones is not None:
        milestones["probe_done"] = time.time()
    trainer_state = {
        **dataclasses.asdict(at),
        "stage": spec.stage,
        "seed": spec.config.training.seed,
        "lr_schedule": dataclasses.asdict(schedule),
    }
    return save_checkpoint(
        checkpoint_root,
        iteration=at.iteration,
        model_parts=model.model_parts,
        optimizer=optimizer,
        trainer_state=trainer_state,
        config=spec.config,
        strategy=spec.strategy,
        probe=record.to_dict(),
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
        run_config=spec.to_dict(),
        console=console,
    )


def init_distributed(config: ConaConfig) -> tuple[torch.device, dist.ProcessGroup | None]:
    """Join the process group on this rank's device. Returns the device and, on CUDA, a gloo group over
    all ranks for host-side agreement (on CPU the default group is gloo and serves)."""
    timeout = timedelta(minutes=config.training.distributed_timeout_minutes)
    use_cuda = config.training.device == "cuda" or (
        config.training.device == "auto" and torch.cuda.is_available()
    )
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
        return device, dist.new_group(backend="gloo", timeout=timeout)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo", timeout=timeout)
    return torch.device("cpu"), None


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


def open_console() -> IO[str]:
    """A stream on the original stdout (a duplicate of fd 1), for the console lines; opened once, before
    :func:`point_output` moves fd 1 to a stage's log."""
    _flush()
    return open(os.dup(1), "w", buffering=1)  # noqa: SIM115 (lives as long as the process)


def point_output(stage_dir: Path, rank: int) -> None:
    """Send this process's stdout/stderr (Python's and native code's) to ``rank<r>.log`` of the stage."""
    stage_dir.mkdir(parents=True, exist_ok=True)
    _flush()
    log_fd = os.open(stage_dir / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)


def write_error(stage_dir: Path, rank: int, err: BaseException) -> Path:
    """``rank<r>.error``: JSON with the rank, the time it failed, the exception and its traceback."""
    message = str(err).strip().splitlines()[0] if str(err).strip() else repr(err)
    record = {
        "rank": rank,
        "time": time.time(),
        "type": type(err).__name__,
        "message": message[:1000],
        "traceback": "".join(traceback.format_exception(err)),
    }
    stage_dir.mkdir(parents=True, exist_ok=True)
    path = stage_dir / f"rank{rank}.error"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(record["traceback"], file=sys.stderr)
    return path


def finish() -> NoReturn:
    """Barrier, leave the process group, and exit without interpreter finalisation."""
    _flush()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    _flush()
    os._exit(0)


def _flush() -> None:
    sys.stdout.flush()
    sys.stderr.flush()


if __name__ == "__main__":
    main()
