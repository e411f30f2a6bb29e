"""Start one stage: the torchrun command, its environment, per-rank logs, and a readable failure.

Each worker writes its own output to ``stages/<N>/rank<r>.log`` and, when it fails, its traceback to
``stages/<N>/rank<r>.error`` (JSON, see :func:`cona.engine.worker.write_error`). torchrun's own output
goes to ``stages/<N>/torchrun.log`` (``torchrun.node<r>.log`` on node r > 0 of a multi-node run, whose nodes
share the stage directory). When a stage fails, :func:`run_stage` raises one :class:`LaunchError`
naming the rank that failed FIRST (the others usually fail afterwards, as a consequence) and its message,
instead of the interleaved tracebacks of every process.

While the workers run, ``stages/<N>/pids.json`` (``pids.node<r>.json`` on node r > 0) records the runner's
and torchrun's process ids and, once torchrun exits, its exit code: ``cona status`` tells from it whether
the run's processes are alive.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from cona import run_files
from cona.atomic_files import write_json_atomic
from cona.engine.spec import LAUNCH_TIME_ENV, RUNNER_PID_ENV, WORKER_CONSOLE_ENV
from cona.errors import LaunchError
from cona.runner.run_lock import popen_holding_locks

DEFAULT_MASTER_PORT_BASE = 29400
"""The port base of a run across nodes without ``--master-port-base`` (every node must know the ports before
any of them starts). On one node, without the flag, torchrun picks a free port for every stage."""
ANY_FREE_PORT = 0
"""A topology's master port when torchrun is to pick a free one (``--standalone``; one node only)."""
WORKER_MODULE = "cona.engine.worker"
TORCHRUN_LOG = run_files.TORCHRUN_LOG
PIDS_FILE = run_files.PIDS
"""Every node's pids record in a stage directory (``pids.json``, ``pids.node<r>.json``)."""
_LOG_TAIL_LINES = 8
_WATCH_INTERVAL_S = 0.5
_TERMINATE_GRACE_S = 15.0


@dataclass(frozen=True, kw_only=True)
class Topology:
    """Where the processes of one stage run: ``nnodes`` nodes of ``nproc_per_node`` processes each."""

    nproc_per_node: int
    master_port: int
    """The rendezvous port; :data:`ANY_FREE_PORT` lets torchrun pick one (one node only)."""
    master_addr: str = "127.0.0.1"
    nnodes: int = 1
    node_rank: int = 0

    def __post_init__(self) -> None:
        if self.master_port == ANY_FREE_PORT and self.nnodes > 1:
            # the other nodes' torchruns could not learn a port picked here
            raise LaunchError(f"a run across {self.nnodes} nodes needs an explicit master port")

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def local_ranks(self) -> range:
        """The global ranks of this node's processes (torchrun numbers them node by node)."""
        return range(self.node_rank * self.nproc_per_node, (self.node_rank + 1) * self.nproc_per_node)

    @property
    def torchrun_log(self) -> str:
        return run_files.torchrun_log_name(self.node_rank)

    @property
    def pids_file(self) -> str:
        return run_files.pids_name(self.node_rank)


def resolve_port_base(flag_value: int | None, num_nodes: int) -> int | None:
    """The run's port base: ``--master-port-base`` when given; across nodes the default base; on one node
    None, for a free port picked by torchrun at every stage (fixed ports collided with other users' runs
    on a shared host)."""
    if flag_value is not None:
        return flag_value
    return DEFAULT_MASTER_PORT_BASE if num_nodes > 1 else None


def stage_master_port(base_port: int | None, stage: int) -> int:
    """The rendezvous port of a stage: ``base + stage``, so consecutive stages never reuse a port that the
    previous one's sockets may still hold (the original CONA scripts derive it from ``step_num`` the same
    way); without a base, :data:`ANY_FREE_PORT`."""
    if base_port is None:
        return ANY_FREE_PORT
    port = base_port + stage
    if not 1024 <= port <= 65535:
        raise LaunchError(f"master port {port} (base {base_port} + stage {stage}) is outside 1024..65535")
    return port


def check_port_free(port: int, addr: str = "") -> None:
    """Refuse a port something already listens on (torchrun would otherwise fail after a long wait);
    :data:`ANY_FREE_PORT` always passes."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torchrun's store does
        try:
            sock.bind((addr, port))
        except OSError:
            raise LaunchError(
                f"master port {port} is in use; choose another base with --master-port-base"
            ) from None


def pick_free_port(addr: str = "") -> int:
    """A port free now, for a launcher that cannot pick one itself (DeepSpeed's); another process may
    still take it before the launcher binds it, which torchrun's ``--standalone`` avoids."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((addr, 0))
        return sock.getsockname()[1]


def torchrun_command(
    spec_path: Path,
    topology: Topology,
    *,
    worker_module: str = WORKER_MODULE,
    python: str = sys.executable,
    worker_args: Sequence[str] = (),
) -> list[str]:
    """``python -m torch.distributed.run ... -m <worker_module> SPEC [worker_args]`` for this node; with
    :data:`ANY_FREE_PORT`, ``--standalone`` (a rendezvous store on a port the OS picks, on localhost)."""
    if topology.master_port == ANY_FREE_PORT:
        rendezvous = ["--standalone"]
    else:
        rendezvous = [
            "--nnodes", str(topology.nnodes),
            "--node-rank", str(topology.node_rank),
            "--master-addr", topology.master_addr,
            "--master-port", str(topology.master_port),
        ]  # fmt: skip
    return [
        python, "-m", "torch.distributed.run", *rendezvous,
        "--nproc-per-node", str(topology.nproc_per_node),
        "--max-restarts", "0",
        "-m", worker_module, str(spec_path), *worker_args,
    ]  # fmt: skip


def worker_env(
    base: Mapping[str, str], *, device_type: str, nproc_per_node: int, cpu_count: int | None = None
) -> dict[str, str]:
    """The workers' environment: unbuffered output and the node's cores shared out between its processes
    (torchrun would set OMP_NUM_THREADS=1, which leaves cores idle on CPU)."""
    env = dict(base)
    env["PYTHONUNBUFFERED"] = "1"
    cores = cpu_count if cpu_count is not None else usable_cores()
    env["OMP_NUM_THREADS"] = str(max(1, cores // nproc_per_node))
    if device_type == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU run must not pick up a GPU through device "auto"
    return env


def run_stage(
    spec_path: Path,
    stage_dir: Path,
    topology: Topology,
    *,
    device_type: str,
    quiet: bool = False,
    worker_module: str = WORKER_MODULE,
    env: Mapping[str, str] | None = None,
    watch: Callable[[], None] | None = None,
) -> None:
    """Run one stage's workers on this node and wait. Raises :class:`LaunchError` if any worker failed.

    ``quiet`` keeps the workers off the terminal: their standard output goes to the torchrun log and rank 0
    writes no per-interval console line. ``watch`` is called about twice a second while the workers run (the
    live console reads the metrics there, a multi-node run checks the other nodes); if it raises, the
    workers are stopped and its exception propagates."""
    if topology.node_rank == 0:
        check_port_free(topology.master_port)
    clear_errors(stage_dir, topology)
    command = torchrun_command(spec_path, topology, worker_module=worker_module)
    full_env = launch_env(env, topology, device_type=device_type, quiet=quiet)
    with open(stage_dir / topology.torchrun_log, "w") as torchrun_log:
        process = start_torchrun(command, full_env, torchrun_log, quiet=quiet)
        pids_path = record_pids(stage_dir / topology.pids_file, topology, process.pid)
        try:
            returncode = _wait(process, watch)
        finally:
            record_exit(pids_path, process.returncode)
    if returncode != 0:
        raise LaunchError(describe_failure(stage_dir, returncode, torchrun_log=topology.torchrun_log))


def clear_errors(stage_dir: Path, topology: Topology) -> None:
    """Make the stage directory; a retried stage must not report the errors of an earlier attempt (other
    nodes' ranks are theirs to clear)."""
    stage_dir.mkdir(parents=True, exist_ok=True)
    for rank in topology.local_ranks:
        (stage_dir / run_files.rank_error_name(rank)).unlink(missing_ok=True)


def launch_env(
    env: Mapping[str, str] | None, topology: Topology, *, device_type: str, quiet: bool
) -> dict[str, str]:
    """The workers' environment (:func:`worker_env` of ``env``, else of ours), with the launch time, this
    runner's pid and, when ``quiet``, no console lines from rank 0."""
    full_env = worker_env(
        env if env is not None else os.environ,
        device_type=device_type,
        nproc_per_node=topology.nproc_per_node,
    )
    full_env[LAUNCH_TIME_ENV] = str(time.time())
    full_env[RUNNER_PID_ENV] = str(os.getpid())  # the workers stop once this process is gone
    if quiet:
        full_env[WORKER_CONSOLE_ENV] = "0"
    return full_env


def start_torchrun(
    command: list[str], env: Mapping[str, str], torchrun_log: IO[str], *, quiet: bool
) -> subprocess.Popen:
    """Start torchrun with its output in ``torchrun_log`` (its standard output on the terminal unless
    ``quiet``)."""
    torchrun_log.write(" ".join(command) + "\n")
    torchrun_log.flush()
    stdout = torchrun_log if quiet else None
    return popen_holding_locks(command, env=env, stdout=stdout, stderr=torchrun_log)


def record_pids(path: Path, topology: Topology, torchrun_pid: int, **extra: object) -> Path:
    """Write who runs the stage on this node: host, runner pid, torchrun pid, when it started, and
    ``extra`` keys."""
    record = {
        "host": socket.gethostname(),
        "node_rank": topology.node_rank,
        "runner_pid": os.getpid(),
        "torchrun_pid": torchrun_pid,
        "started": time.time(),
        **extra,
    }
    write_json_atomic(path, record)
    return path


def record_exit(path: Path, returncode: int | None) -> None:
    """Add torchrun's end to the pids record (``returncode`` None: it was still running when the runner
    stopped waiting, e.g. the runner was interrupted and torchrun did not stop)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return  # removed or unreadable meanwhile: there is no record to complete
    write_json_atomic(path, {**record, "ended": time.time(), "returncode": returncode})


def _wait(process: subprocess.Popen, watch: Callable[[], None] | None) -> int:
    """Wait for torchrun, calling ``watch`` about twice a second meanwhile; stop torchrun (it stops its
    workers) if it raises. Returns as torchrun exits, not at the next watch: a switch through a checkpoint
    waits for the stage's end before the next stage starts."""
    try:
        while watch is not None and process.poll() is None:
            watch()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=_WATCH_INTERVAL_S)
        return process.wait()
    except BaseException:
        stop_process(process)
        raise


def stop_process(process: subprocess.Popen, grace_s: float = _TERMINATE_GRACE_S) -> None:
    """SIGTERM (torchrun passes it on to its workers), SIGKILL after ``grace_s``; waits for the end."""
    process.terminate()
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def describe_failure(stage_dir: Path, returncode: int, *, torchrun_log: str = TORCHRUN_LOG) -> str:
    """One message about the first rank that failed: its error if it wrote one, else the end of its log."""
    stage = stage_dir.name
    errors = _read_errors(stage_dir)
    killed = _killed_root_cause(stage_dir / torchrun_log)
    if killed is not None and killed[0] not in {error["rank"] for error in errors}:
        # A rank killed by a signal writes no error; the others then fail on its lost connection and would
        # otherwise be named as the cause.
        rank, signal_name = killed
        after = f"; ranks {sorted({error['rank'] for error in errors})} failed after it" if errors else ""
        return (
            f"stage {stage}: rank {rank} was killed by {signal_name} (it wrote no error; "
            f"log {stage_dir / run_files.rank_log_name(rank)}){after}"
        )
    if errors:
        first = min(errors, key=lambda error: error["time"])
        others = sorted({error["rank"] for error in errors} - {first["rank"]})
        also = f"; ranks {others} failed after it" if others else ""
        error_path = stage_dir / run_files.rank_error_name(first["rank"])
        return (
            f"stage {stage}: rank {first['rank']} failed: {first['type']}: {first['message']} "
            f"(traceback: {error_path}{also})"
        )
    rank = _root_cause_rank(stage_dir / torchrun_log)
    log = stage_dir / run_files.rank_log_name(rank) if rank is not None else stage_dir / torchrun_log
    who = f"rank {rank}" if rank is not None else "the workers"
    tail = " | ".join(_tail(log))
    return f"stage {stage}: {who} failed (torchrun exit code {returncode}); end of {log}: {tail}"


def diverged(stage_dir: Path) -> str | None:
    """The message of a rank whose last attempt at the stage stopped because training diverged, if any."""
    found = [error for error in _read_errors(stage_dir) if error["type"] == "TrainingDiverged"]
    return min(found, key=lambda error: error["time"])["message"] if found else None


def _read_errors(stage_dir: Path) -> list[dict]:
    errors = []
    for path in stage_dir.glob(run_files.RANK_ERROR_GLOB):
        try:
            error = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue  # written while the process was being killed; the log tells the rest
        if {"rank", "time", "type", "message"} <= error.keys():
            errors.append(error)
    return errors


def _killed_root_cause(torchrun_log: Path) -> tuple[int, str] | None:
    """(rank, signal name) when torchrun's first observed failure is a rank killed by a signal."""
    try:
        text = torchrun_log.read_text(errors="replace")
    except OSError:
        return None
    _, _, after = text.partition("Root Cause")
    match = re.search(r"rank\s*:\s*(\d+).*?exitcode\s*:\s*-(\d+)[^\n]*?\((SIG[A-Z]+)\)", after, re.S)
    return (int(match.group(1)), match.group(3)) if match else None


def _root_cause_rank(torchrun_log: Path) -> int | None:
    """The rank torchrun names under 'Root Cause (first observed failure)'."""
    try:
        text = torchrun_log.read_text(errors="replace")
    except OSError:
        return None
    _, _, after = text.partition("Root Cause")
    match = re.search(r"rank\s*:\s*(\d+)", after)
    return int(match.group(1)) if match else None


def _tail(path: Path) -> list[str]:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return [f"({path} is missing)"]
    return [line.strip() for line in lines if line.strip()][-_LOG_TAIL_LINES:]


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
