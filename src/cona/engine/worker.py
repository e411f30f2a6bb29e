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
session. A rank whose runner (``CONA_RUNNER_PID``) or torchrun is gone stops waiting and exits 1; so do
all ranks during training, within about a second (:class:`cona.engine.session.RunnerWatch`).

The process ends with ``os._exit`` after a barrier: once DTensor collectives ran on gloo, interpreter
finalisation can abort inside gloo's threads, so no rank goes through it.
"""

# ruff: noqa: E402 (the imports follow the clock that times them)
from __future__ import annotations

import time

IMPORTS_START = time.time()
"""Unix time the worker module began importing (torch and CONA): the stage timings' ``imports_start``."""

import itertools
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import IO, NoReturn

import torch
import torch.distributed as dist

from cona import run_files
from cona.atomic_files import write_json_atomic
from cona.config import ConaConfig
from cona.engine.compile_warmup import start_compile_warmup
from cona.engine.parallel_dims import validate_layout
from cona.engine.session import next_stage, release_stage_memory
from cona.engine.session_files import SESSION_FLAG
from cona.engine.spec import LAUNCH_TIME_ENV, WORKER_CONSOLE_ENV, StageResult, StageSpec
from cona.engine.stage_build import (
    InPlaceState,
    build_stage,
    continue_in_place,
    destroy_mesh_groups,
    drop_in_place_state,
    verify_loaded,
)
from cona.engine.trainer import train_stage


def main(argv: list[str] | None = None) -> NoReturn:
    process_start = time.time()
    args = sys.argv[1:] if argv is None else argv
    rank = int(os.environ.get("RANK", "0"))
    spec_path = Path(args[0])
    session_dir = Path(args[2]) if len(args) == 3 and args[1] == SESSION_FLAG else None
    echo = rank == 0 and os.environ.get(WORKER_CONSOLE_ENV) != "0"  # else the runner's console shows them
    timings = {
        "launch": float(os.environ.get(LAUNCH_TIME_ENV, process_start)),
        "imports_start": IMPORTS_START,
        "process_start": process_start,
    }
    console, joined, carried = None, None, None
    for number in itertools.count(1):
        error_dir = spec_path.parent  # the stage directory, also when the spec itself cannot be read
        try:
            spec = StageSpec.read(spec_path)
            error_dir = spec.stage_dir
            console = console or open_console()
            point_output(spec.stage_dir, rank)
            joined = joined or init_distributed(spec.config)  # once: a session keeps the process group
            if carried is not None and not spec.continue_in_place:  # the stage builds its own
                drop_in_place_state(carried)
                carried = None
                release_stage_memory(spec.config)
            _, carried = run_stage(
                spec, *joined, console=console if echo else None, timings=timings, carried=carried
            )
            command = (
                next_stage(spec, session_dir, number, rank, keep_state=carried is not None)
                if session_dir
                else {"stop": True}
            )
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
    carried: InPlaceState | None = None,
) -> tuple[StageResult, InPlaceState | None]:
    """Build (or continue in place), resume, train and save one stage; rank 0 writes ``stage_result.json``.
    Returns the result and, when the stage hands its state over to the session's next stage (an in-place
    switch), that state; otherwise the stage's mesh groups are destroyed at the end."""
    # The one layout check of a worker: where the strategy arrives (built fresh or continued in place).
    config = spec.config
    validate_layout(config.model, config.training, spec.strategy, world_size=dist.get_world_size())
    verdict = None
    if spec.continue_in_place:
        context, progress = continue_in_place(carried, spec, console=console, timings=timings)
    else:
        context, progress = build_stage(
            spec, device, control_group=control_group, console=console, timings=timings
        )
        if spec.load_path is not None:
            timings["load_done"] = time.time()
            verdict = verify_loaded(context, spec.load_path, iteration=progress.iteration)
            timings["verify_done"] = time.time()
    timings["setup_done"] = time.time()
    start_compile_warmup(spec, device)
    try:
        reason = train_stage(context, progress)
    finally:
        if context.logger is not None:
            context.logger.close()
        if context.step_trace is not None:
            context.step_trace.close()
    hand_over = reason == "switch_in_place" or (reason == "completed" and spec.hand_over_in_place)
    saves = not hand_over and (reason == "switch_requested" or spec.save_at_end)
    checkpoint = context.save(progress, milestones=timings) if saves else None
    timings["save_done"] = time.time()
    # Where a probe's candidate won, the stage ended where the probe began: the branch's samples belong to
    # the next stage (the candidate's), which continues the state that trained them.
    ended = context.probes.stage_end or progress
    result = StageResult(
        stage=spec.stage,
        reason=reason,
        last_iteration=ended.iteration,
        consumed_samples=ended.consumed_samples,
        consumed_tokens=ended.consumed_tokens,
        checkpoint=str(checkpoint) if checkpoint is not None else None,
        timings=timings,
        switch_check=verdict.to_dict() if verdict is not None else None,
        handed_over=hand_over,
    )
    if dist.get_rank() == 0:
        result.write(spec.result_path)
    if hand_over:
        return result, InPlaceState(context=context, progress=progress, stage_end=ended)
    destroy_mesh_groups(context.model.mesh)
    return result, None


def init_distributed(config: ConaConfig) -> tuple[torch.device, dist.ProcessGroup | None]:
    """Join the process group on this rank's device. Returns the device and, on CUDA, a gloo group over
    all ranks for host-side agreement (on CPU the default group is gloo and serves)."""
    timeout = timedelta(minutes=config.training.runtime.distributed_timeout_minutes)
    use_cuda = config.training.runtime.device == "cuda" or (
        config.training.runtime.device == "auto" and torch.cuda.is_available()
    )
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
        return device, dist.new_group(backend="gloo", timeout=timeout)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo", timeout=timeout)
    return torch.device("cpu"), None


def open_console() -> IO[str]:
    """A stream on the original stdout (a duplicate of fd 1), for the console lines; opened once, before
    :func:`point_output` moves fd 1 to a stage's log."""
    _flush()
    return open(os.dup(1), "w", buffering=1)  # noqa: SIM115 (lives as long as the process)


def point_output(stage_dir: Path, rank: int) -> None:
    """Send this process's stdout/stderr (Python's and native code's) to ``rank<r>.log`` of the stage."""
    stage_dir.mkdir(parents=True, exist_ok=True)
    _flush()
    log_fd = os.open(stage_dir / run_files.rank_log_name(rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
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
    path = write_json_atomic(stage_dir / run_files.rank_error_name(rank), record)
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
