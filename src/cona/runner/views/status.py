"""``cona status``: one screen saying where a run is, from its run directory alone.

Stage and target come from the run state (chains) or the stage specs (a fixed-strategy run); progress, loss
and throughput from the last metrics line; the checkpoint from the stage results and run state, with the
``latest`` / ``latest_universal`` markers beside it; the decision from ``decisions.jsonl``.

A run none of whose processes runs any more is not "running" whatever its run state says: it finished,
failed or was stopped (the runner's recorded end, :mod:`cona.runner.run_end`), or was killed (no end
recorded). The checkpoint shown is the newest complete one of any kind: a stage's last, or a periodic one its
layout's ``latest`` marker names.

Liveness: the runner records its own and torchrun's process ids (and torchrun's exit) per stage and node in
``stages/<N>/pids*.json`` (:func:`cona.runner.launch.run_stage`); the newest stage's record is checked with
signal 0 on the host that wrote it, and on Linux against the process's start time in ``/proc``, so a pid
reused by a later process does not read as alive. Runs from before those records are looked for by command
line instead (``/proc``, this host only): their workers name the stage spec inside the run directory.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from cona import run_files
from cona.engine.checkpoint.info import LATEST, LATEST_UNIVERSAL, STEP_DIR
from cona.engine.checkpoint.paths import run_checkpoints
from cona.metrics_record import MetricsRecord
from cona.processes import PROC, pid_alive
from cona.processes import process_state as process_state  # re-exported: it lived here
from cona.runner.publish import read_marker
from cona.runner.run_end import read_runner_end
from cona.runner.state import ONLINE_CHAIN
from cona.runner.views.report import RunData, load_run, strategy_label


@dataclass(frozen=True, kw_only=True)
class CheckpointStatus:
    path: Path
    exists: bool
    markers: dict[str, str | None]
    """``latest`` and ``latest_universal`` in the checkpoint's layout directory: the name each points at,
    None when missing."""


@dataclass(frozen=True, kw_only=True)
class RecordedProcesses:
    """One node's part of a stage as its ``pids*.json`` records it, checked from this host."""

    stage: int
    host: str
    runner_pid: int
    torchrun_pid: int
    started: float
    """Unix time the record was written (the stage's launch)."""
    returncode: int | None
    ended: bool
    """torchrun's exit was recorded."""
    runner_alive: bool | None
    """None when the record was written on another host (signals cannot reach it from here)."""
    torchrun_alive: bool | None
    session: bool = False
    """The stage ran in a worker session (:mod:`cona.runner.worker_session`): its recorded end is the
    stage's, and torchrun may live on into the next stage."""


@dataclass(frozen=True, kw_only=True)
class Processes:
    workers: tuple[int, ...] | None
    """Worker pids of this run alive on this host, found by command line (also beside pids records: a
    killed runner's workers may outlive it and torchrun); None when this host cannot tell."""
    launchers: tuple[int, ...] = ()
    """torchrun pids of this run, found the same way."""
    recorded: tuple[RecordedProcesses, ...] = ()
    """The newest stage's pids records, one per node; when present they are the answer, with any live
    worker added."""


@dataclass(frozen=True, kw_only=True)
class RunStatus:
    run: RunData
    stage: int | None
    stages_total: int | None
    stage_state: str
    """``running``, ``finished``, or the chain status of the current stage (pending, trained, ...)."""
    strategy: dict[str, Any] | None
    target_iteration: int | None
    target_tokens: int | None
    """The stage's token stop rule (online runs stop at a token budget)."""
    last_record: MetricsRecord | None
    last_eval: MetricsRecord | None
    checkpoint: CheckpointStatus | None
    last_decision: dict[str, Any] | None
    processes: Processes
    record_age_s: float | None


def collect_status(run_dir: Path, *, now: float | None = None, proc_root: Path = PROC) -> RunStatus:
    run = load_run(run_dir)
    stage, total, stage_state, target = _stage_position(run)
    last = run.records[-1] if run.records else None
    evals = [record for record in run.records if record.eval_ppl is not None]
    spec = run.specs.get(stage) if stage is not None else None
    strategy = spec.get("strategy") if spec else None
    if strategy is None and last is not None:
        strategy = last.to_dict()
    processes = run_processes(run.run_dir, proc_root)
    if stage_state != "finished":
        stage_state = _dead_run_state(run.run_dir, processes) or stage_state
    return RunStatus(
        run=run,
        stage=stage,
        stages_total=total,
        stage_state=stage_state,
        strategy=strategy,
        target_iteration=target,
        target_tokens=spec.get("max_tokens") if spec else None,
        last_record=last,
        last_eval=evals[-1] if evals else None,
        checkpoint=_newest_checkpoint(run),
        last_decision=run.decisions[-1] if run.decisions else None,
        processes=processes,
        record_age_s=(now if now is not None else time.time()) - float(last.time) if last else None,
    )


def _stage_position(run: RunData) -> tuple[int | None, int | None, str, int | None]:
    """(stage number, stages in the run, its state, its target iteration)."""
    if run.state is not None and run.state.stages:  # a state of no stages says nothing of where it is
        current = run.state.current
        total = len(run.state.stages)
        if current is None:
            last = run.state.stages[-1]
            return last.step_num, total, "finished", last.target_iteration
        state = "running" if current.status == "running" else current.status
        if run.state.chain_path == ONLINE_CHAIN:
            # The search adds a stage at each switch, so the count so far is no total: "2 of 2" would
            # read as the last stage.
            switches = current.step_num - 1
            state += f", online: {switches} switch{'es' if switches != 1 else ''} so far"
            return current.step_num, None, state, current.target_iteration
        return current.step_num, total, state, current.target_iteration
    numbers = sorted(set(run.specs) | {int(record.stage) for record in run.records})
    if not numbers:
        return None, None, "not started", None
    stage = numbers[-1]
    target = run.specs.get(stage, {}).get("target_iteration")
    return stage, None, "finished" if stage in run.stage_results else "running", target


def _dead_run_state(run_dir: Path, processes: Processes) -> str | None:
    """``failed: ...``, ``stopped by SIGTERM ...`` or ``killed ...`` for a run none of whose processes runs
    on this host any more, from the newest runner's recorded end (one older than the newest stage's launch
    is an earlier runner's); None while one runs, or when this host cannot tell (a stage's record written on
    another host)."""
    records = processes.recorded
    if processes.workers or processes.launchers:
        return None
    if any(record.runner_alive is None or record.runner_alive or record.torchrun_alive for record in records):
        return None
    end = read_runner_end(run_dir)
    newest = max(records, key=lambda record: record.started, default=None)
    if newest is not None and (end is None or end.ended < newest.started):
        return (
            f"killed: runner pid {newest.runner_pid} is gone and recorded no end (SIGKILL or a lost "
            f"machine); the same command resumes the run"
        )
    if end is not None and end.how == "stopped":
        return f"{end.message}; the same command resumes the run"
    if end is not None and end.how == "failed":
        return f"failed: {end.message}"
    return None


def _newest_checkpoint(run: RunData) -> CheckpointStatus | None:
    """The newest complete checkpoint of the run, of any kind: what its stage results and run state recorded
    (a stage's last), and what the ``latest`` / ``latest_universal`` markers of its own checkpoint folders
    name (a periodic one a stage saved before it was stopped or killed); with its layout's markers."""
    recorded = [(number, result.get("checkpoint")) for number, result in run.stage_results.items()]
    if run.state is not None:
        recorded += [(stage.step_num, stage.checkpoint) for stage in run.state.stages]
    candidates = [(_step_of(path), 1, Path(path)) for _, path in recorded if path]
    candidates += [(_step_of(str(path)), 0, path) for path in _marked_checkpoints(run)]
    if not candidates:
        return None
    path = max(candidates, key=lambda item: item[:2])[2]
    markers = {name: read_marker(path.parent / name) for name in (LATEST, LATEST_UNIVERSAL)}
    return CheckpointStatus(path=path, exists=path.is_dir(), markers=markers)


def _marked_checkpoints(run: RunData) -> list[Path]:
    """The checkpoints the markers of the run's own checkpoint folder name (markers name only complete
    ones)."""
    workdirs = {run.state.workdir} if run.state is not None and run.state.workdir else set()
    workdirs |= {spec["workdir"] for spec in run.specs.values() if isinstance(spec.get("workdir"), str)}
    found = []
    for workdir in workdirs:
        for marker in run_checkpoints(Path(workdir), run.name).rglob("latest*"):
            name = read_marker(marker) if marker.name in (LATEST, LATEST_UNIVERSAL) else None
            if name and (marker.parent / name).is_dir():
                found.append(marker.parent / name)
    return found


def _step_of(path: str) -> int:
    match = STEP_DIR.fullmatch(Path(path).name)
    return int(match.group(1)) if match else -1


def run_processes(run_dir: Path, proc_root: Path = PROC) -> Processes:
    """From the newest stage's pids records; by command line for a run that has none."""
    recorded = recorded_processes(run_dir, proc_root)
    found = find_processes(run_dir, proc_root)
    return dataclasses.replace(found, recorded=recorded) if recorded else found


def recorded_processes(run_dir: Path, proc_root: Path = PROC) -> tuple[RecordedProcesses, ...]:
    """The pids records of the newest stage that has any (one per node), each checked for liveness."""
    by_stage: dict[int, list[Path]] = {}
    for path in Path(run_dir).glob(f"{run_files.STAGES}/*/{run_files.PIDS_GLOB}"):
        if path.parent.name.isdigit():
            by_stage.setdefault(int(path.parent.name), []).append(path)
    if not by_stage:
        return ()
    stage = max(by_stage)
    records = (_read_pids(path, stage, proc_root) for path in sorted(by_stage[stage]))
    return tuple(record for record in records if record is not None)


def _read_pids(path: Path, stage: int, proc_root: Path) -> RecordedProcesses | None:
    try:
        raw = json.loads(path.read_text())
        runner_pid, torchrun_pid = int(raw["runner_pid"]), int(raw["torchrun_pid"])
        started, host = float(raw["started"]), str(raw["host"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # unreadable: the newest stage then answers from its other nodes, if any
    here = host == socket.gethostname()
    session = "session" in raw
    return RecordedProcesses(
        stage=stage,
        host=host,
        runner_pid=runner_pid,
        torchrun_pid=torchrun_pid,
        started=started,
        returncode=raw.get("returncode"),
        ended="ended" in raw,
        runner_alive=pid_alive(runner_pid, started, proc_root) if here else None,
        torchrun_alive=pid_alive(torchrun_pid, started, proc_root)
        if here and ("ended" not in raw or session)
        else None,
        session=session,
    )


def find_processes(run_dir: Path, proc_root: Path = PROC) -> Processes:
    """The processes on this host whose command line names a stage spec of this run directory."""
    if not proc_root.is_dir():
        return Processes(workers=None)
    marker = str(run_files.stages_path(Path(run_dir).resolve())) + "/"
    workers, launchers = [], []
    for entry in proc_root.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue  # ended while we looked, or not ours to read
        if any(arg.startswith(marker) and arg.endswith(run_files.SPEC) for arg in argv):
            (launchers if "torch.distributed.run" in argv else workers).append(int(entry.name))
    return Processes(workers=tuple(sorted(workers)), launchers=tuple(sorted(launchers)))


def render_status(status: RunStatus, console: Console) -> None:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", justify="right")
    grid.add_column(overflow="fold")  # long checkpoint paths wrap rather than end in an ellipsis
    for key, value in status_lines(status):
        grid.add_row(key, value)
    console.print(Panel(grid, title=f"run {status.run.name}", subtitle=str(status.run.run_dir), expand=False))
    for warning in status.run.warnings:
        console.print(f"warning: {warning}", style="yellow", highlight=False)


def status_lines(status: RunStatus) -> list[tuple[str, str]]:
    """The (label, text) rows of the screen."""
    last = status.last_record
    lines = [("stage", _stage_text(status)), ("strategy", _strategy_text(status.strategy))]
    if last is None:
        lines.append(("iteration", "no metrics yet"))
    else:
        target = f" of {status.target_iteration}" if status.target_iteration else ""
        age = (
            f" (last metrics {_duration(status.record_age_s)} ago)" if status.record_age_s is not None else ""
        )
        lines += [
            ("iteration", f"{last.iteration}{target}{age}"),
            ("tokens", _tokens_text(last, status.target_tokens)),
            ("loss", _loss_text(last)),
            ("eval", _eval_text(status.last_eval)),
        ]
    lines += [
        ("checkpoint", _checkpoint_text(status.checkpoint)),
        ("markers", _markers_text(status.checkpoint, finished=status.stage_state == "finished")),
        ("decision", _decision_text(status.last_decision)),
        ("processes", _process_text(status)),
    ]
    return lines


def _stage_text(status: RunStatus) -> str:
    if status.stage is None:
        return status.stage_state
    of = f" of {status.stages_total}" if status.stages_total else ""
    return f"{status.stage}{of} ({status.stage_state})"


def _strategy_text(strategy: dict[str, Any] | None) -> str:
    return strategy_label(strategy) if strategy else "unknown"


def _tokens_text(record: MetricsRecord, target: int | None) -> str:
    tokens = int(record.consumed_tokens)
    of = f" of {target:,} ({100 * tokens / target:.0f}%)" if target else ""
    return f"{tokens:,}{of}, {record.consumed_samples or 0:,} samples"


def _loss_text(record: MetricsRecord) -> str:
    speed = record.tokens_per_s
    parts = [f"{record.loss:.4f}"]
    if speed is not None:
        parts.append(f"{speed:,.0f} tokens/s")
    if record.mfu is not None:
        parts.append(f"MFU {100 * record.mfu:.1f}%")
    return ", ".join(parts)


def _eval_text(record: MetricsRecord | None) -> str:
    if record is None:
        return "no evaluation yet"
    ppl, loss, iteration = record.eval_ppl, record.eval_loss, record.iteration
    loss_text = f" (loss {loss:.4f})" if loss is not None else ""
    return f"perplexity {ppl:.2f}{loss_text} at iteration {iteration}"


def _checkpoint_text(checkpoint: CheckpointStatus | None) -> str:
    if checkpoint is None:
        return "none recorded yet"
    return f"{checkpoint.path}{'' if checkpoint.exists else ' (missing on disk: pruned or moved)'}"


def _markers_text(checkpoint: CheckpointStatus | None, *, finished: bool) -> str:
    """The layout's markers; a missing ``latest_universal`` is said only while the run goes on (a later
    stage may need it), never for a finished run, which has no later stage."""
    if checkpoint is None:
        return "-"
    markers = {
        name: target
        for name, target in checkpoint.markers.items()
        if target or not (finished and name == LATEST_UNIVERSAL)
    }
    return ", ".join(
        f"{name} -> {target}" if target else f"{name} missing" for name, target in markers.items()
    )


def _decision_text(decision: dict[str, Any] | None) -> str:
    if decision is None:
        return "none (no decisions.jsonl: not an online run)"
    action = decision.get("decision", "?")
    candidate = decision.get("candidate")
    target = ""
    if action != "stay" and isinstance(candidate, dict) and isinstance(candidate.get("strategy"), dict):
        target = f" to {strategy_label(candidate['strategy'])}"
    return f"{action}{target} at iteration {decision.get('iteration', '?')}: {decision.get('reason', '')}"


def _process_text(status: RunStatus) -> str:
    processes = status.processes
    if processes.recorded:
        recorded = _recorded_text(processes.recorded, finished=status.stage_state == "finished")
        if processes.workers:
            return f"{recorded}; {len(processes.workers)} worker(s) alive (pids {_pids(processes.workers)})"
        return recorded
    if processes.workers is None:
        return "unknown (no /proc on this host; the runner records no process ids)"
    if processes.workers or processes.launchers:
        return (
            f"{len(processes.workers)} worker(s) alive on this host (pids {_pids(processes.workers)}), "
            f"torchrun {_pids(processes.launchers)}"
        )
    if status.stage_state == "finished":
        return "none (the run finished)"
    return "no worker of this run alive on this host (stopped, between stages, or on other nodes)"


def _recorded_text(records: Sequence[RecordedProcesses], *, finished: bool) -> str:
    alive = any(record.runner_alive or record.torchrun_alive for record in records)
    if finished and not alive:
        return "none (the run finished)"
    return "; ".join(_node_text(record) for record in records)


def _node_text(record: RecordedProcesses) -> str:
    where = f"stage {record.stage}"
    if record.runner_alive is None:
        return (
            f"{where} on host {record.host} (runner pid {record.runner_pid}, torchrun pid "
            f"{record.torchrun_pid}): not checkable from {socket.gethostname()}"
        )
    runner = f"runner pid {record.runner_pid} {'alive' if record.runner_alive else 'gone'}"
    if record.ended and record.session:
        kept = "alive, kept for the next stage" if record.torchrun_alive else "gone"
        torchrun = f"stage ended with code {record.returncode}, torchrun pid {record.torchrun_pid} {kept}"
    elif record.ended:
        torchrun = f"torchrun pid {record.torchrun_pid} exited with code {record.returncode}"
    elif record.torchrun_alive:
        torchrun = f"torchrun pid {record.torchrun_pid} alive"
    else:
        torchrun = f"torchrun pid {record.torchrun_pid} gone, its exit not recorded"
    return f"{where}: {runner}, {torchrun}"


def _pids(pids: Sequence[int]) -> str:
    return " ".join(map(str, pids)) or "none"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = max(seconds, 0.0)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"
