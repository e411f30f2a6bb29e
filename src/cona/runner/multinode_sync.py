"""How the runners of a multi-node run agree on every stage boundary: files on the shared filesystem.

**Agreement.** Every node runs the same command. The runners talk through files in ``<run_dir>/nodes/`` on
the shared filesystem (written atomically: temporary file, then rename), never through sockets of their own:

- ``node<r>.json``: a heartbeat each runner rewrites every second (a nonce and a counter). A node is alive
  while its counter moves; the clocks of different hosts are never compared.
- ``session.json``: node 0, once every node's heartbeat has moved, names the nonces of this session's nodes.
- ``command.json``: node 0's decision: run stage N (spec, port), ``finish``, or ``abort`` (with why).
- ``report<r>.json``: node r's runner, after its torchrun exited: left the stage ok, or failed (with why).

Node 0 alone plans, keeps the run state and publishes, and only after every node reported leaving the stage
successfully. Every wait ends after ``training.distributed_timeout_minutes`` with an error naming the node
that did not arrive.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cona.errors import LaunchError
from cona.runner.multinode import NodePlacement

if TYPE_CHECKING:
    from cona.runner.multinode import RemoteRunners

HEARTBEAT_S = 1.0
POLL_S = 0.3
NODES_DIR = "nodes"


def write_json(path: Path, body: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as handle:
        json.dump(body, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None  # not written yet, or a shared filesystem's passing error: the next poll reads again


class Heartbeat:
    """Rewrites ``node<r>.json`` every second from a thread, while the runner lives."""

    def __init__(self, directory: Path, rank: int) -> None:
        self.path = directory / f"node{rank}.json"
        self.nonce = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True, name=f"cona-heartbeat-{rank}")

    def __enter__(self) -> Heartbeat:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._write(0)
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _beat(self) -> None:
        count = 1
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._write(count)
            except OSError:
                continue  # a passing filesystem error; the peers only time out if it lasts
            count += 1

    def _write(self, count: int) -> None:
        write_json(self.path, {"nonce": self.nonce, "beat": count, "host": socket.gethostname()})


class PeerWatch:
    """When each peer's heartbeat last moved, by this process's own clock."""

    def __init__(self, directory: Path, ranks: Sequence[int], placement: NodePlacement, timeout_s: float):
        self.directory, self.placement, self.timeout_s = directory, placement, timeout_s
        self._seen: dict[int, tuple[Any, float | None]] = {rank: (self._read(rank), None) for rank in ranks}

    def _read(self, rank: int) -> Any:
        beat = read_json(self.directory / f"node{rank}.json")
        return (beat["nonce"], beat["beat"]) if beat else None

    def poll(self) -> None:
        now = time.monotonic()
        for rank, (last, _) in self._seen.items():
            current = self._read(rank)
            if current is not None and current != last:
                self._seen[rank] = (current, now)

    def nonce(self, rank: int) -> str | None:
        last, moved = self._seen[rank]
        return last[0] if moved is not None else None

    def missing(self) -> list[int]:
        """Peers whose heartbeat has not moved since this watch began."""
        return [rank for rank, (_, moved) in self._seen.items() if moved is None]

    def check_alive(self) -> None:
        now = time.monotonic()
        for rank, (_, moved) in self._seen.items():
            if moved is not None and now - moved > self.timeout_s:
                raise LaunchError(
                    f"{self.placement.label(rank)} stopped responding: no heartbeat in "
                    f"{self.directory / f'node{rank}.json'} for {now - moved:.0f} s; its runner is gone"
                )


def wait_until(
    ready: Callable[[], Any], *, timeout_s: float, on_timeout: Callable[[], str], check: Callable[[], None]
) -> Any:
    """Poll ``ready()`` until it returns something truthy; ``check()`` may raise meanwhile."""
    deadline = time.monotonic() + timeout_s
    while True:
        check()
        value = ready()
        if value:
            return value
        if time.monotonic() > deadline:
            raise LaunchError(on_timeout())
        time.sleep(POLL_S)


def timeout_text(timeout_s: float) -> str:
    amount = f"{timeout_s / 60:g} min" if timeout_s >= 60 else f"{timeout_s:g} s"
    return f"{amount} (training.distributed_timeout_minutes)"


def _my_session(directory: Path, rank: int, nonce: str) -> dict | None:
    session = read_json(directory / "session.json")
    return session if session and session.get("members", {}).get(str(rank)) == nonce else None


LocalStage = Callable[[Callable[[], None]], None]
"""Runs this node's torchrun for a stage; calls the given ``watch`` while it waits (``watch`` may raise)."""


class Coordinator:
    """Node 0's side: gathers the nodes, announces each stage, and waits for every node to leave it."""

    def __init__(
        self,
        run_dir: Path,
        placement: NodePlacement,
        *,
        timeout_s: float,
        out: Callable[[str], None],
        remote: RemoteRunners | None = None,
    ) -> None:
        self.directory = Path(run_dir) / NODES_DIR
        self.placement, self.timeout_s, self.out, self.remote = placement, timeout_s, out, remote
        self.peers = range(1, placement.num_nodes)
        self._heartbeat = Heartbeat(self.directory, 0)
        self._watch = PeerWatch(self.directory, self.peers, placement, timeout_s)
        self._seq = 0

    def __enter__(self) -> Coordinator:
        self._heartbeat.__enter__()
        try:
            if self.remote is not None:
                self.remote.start()
            self._join()
        except BaseException as err:
            self.__exit__(type(err), err, None)
            raise
        return self

    def __exit__(self, kind: type | None, err: BaseException | None, _tb: object) -> None:
        try:
            if err is None:
                self._command(action="finish")
            else:
                self._command(action="abort", message=str(err) or type(err).__name__)
            if self.remote is not None:
                self.remote.stop(wait_s=self.timeout_s if err is None else 10.0)
        finally:
            self._heartbeat.__exit__()

    def _join(self) -> None:
        def arrived() -> bool:
            self._watch.poll()
            return not self._watch.missing()

        wait_until(
            arrived,
            timeout_s=self.timeout_s,
            on_timeout=lambda: (
                f"{', '.join(self.placement.label(r) for r in self._watch.missing())} did not start within "
                f"{timeout_text(self.timeout_s)}: no heartbeat in {self.directory}; run the same command "
                f"there with its --node-rank"
            ),
            check=self._check_remote,
        )
        (self.directory / "command.json").unlink(missing_ok=True)
        for rank in self.peers:
            (self.directory / f"report{rank}.json").unlink(missing_ok=True)
        members = {str(rank): self._watch.nonce(rank) for rank in self.peers}
        write_json(self.directory / "session.json", {"session": self._heartbeat.nonce, "members": members})
        self.out(f"all {self.placement.num_nodes} nodes joined: {', '.join(self.placement.hosts)}")

    def _command(self, **body: Any) -> None:
        self._seq += 1
        write_json(
            self.directory / "command.json", {"session": self._heartbeat.nonce, "seq": self._seq, **body}
        )

    def _check_remote(self) -> None:
        if self.remote is not None:
            self.remote.check()

    def run_stage(self, stage: int, spec_path: Path, port: int, run_local: LocalStage) -> None:
        """Announce the stage, run this node's part, and return once every node left it successfully."""
        self._command(action="stage", stage=stage, spec=str(spec_path), port=port)
        seq = self._seq

        def watch() -> None:
            self._watch.poll()
            self._raise_failed_report(stage, seq)
            self._watch.check_alive()
            self._check_remote()

        try:
            run_local(watch)
        except LaunchError as err:
            raise LaunchError(f"{err}{self._peer_notes(seq)}") from None
        wait_until(
            lambda: not self._unreported(seq),
            timeout_s=self.timeout_s,
            on_timeout=lambda: (
                f"stage {stage}: {', '.join(self.placement.label(r) for r in self._unreported(seq))} did not "
                f"report leaving training within {timeout_text(self.timeout_s)}"
            ),
            check=watch,
        )

    def _report(self, rank: int, seq: int) -> dict | None:
        report = read_json(self.directory / f"report{rank}.json")
        ours = report and report.get("session") == self._heartbeat.nonce and report.get("seq") == seq
        return report if ours else None

    def _unreported(self, seq: int) -> list[int]:
        return [rank for rank in self.peers if self._report(rank, seq) is None]

    def _raise_failed_report(self, stage: int, seq: int) -> None:
        for rank in self.peers:
            report = self._report(rank, seq)
            if report is not None and not report["ok"]:
                raise LaunchError(f"stage {stage}: {self.placement.label(rank)} failed: {report['message']}")

    def _peer_notes(self, seq: int) -> str:
        notes = []
        for rank in self.peers:
            report = self._report(rank, seq)
            if report is None:
                notes.append(f"{self.placement.label(rank)} has not reported leaving the stage")
            elif not report["ok"]:
                notes.append(f"{self.placement.label(rank)} failed: {report['message']}")
        return f" [{'; '.join(notes)}]" if notes else ""


FollowerStage = Callable[[int, Path, int, Callable[[], None]], None]
"""Runs this node's torchrun for (stage, spec path, master port), calling ``watch`` while it waits."""


def follow(
    run_dir: Path,
    placement: NodePlacement,
    *,
    timeout_s: float,
    run_local: FollowerStage,
    out: Callable[[str], None],
) -> None:
    """Node r > 0: join node 0's session, run every stage it announces, report leaving each one."""
    directory, rank = Path(run_dir) / NODES_DIR, placement.node_rank
    node0 = PeerWatch(directory, [0], placement, timeout_s)
    with Heartbeat(directory, rank) as heartbeat:
        session = wait_until(
            lambda: _my_session(directory, rank, heartbeat.nonce),
            timeout_s=timeout_s,
            on_timeout=lambda: (
                f"{placement.label(0)} did not gather the nodes within {timeout_text(timeout_s)}"
            ),
            check=node0.poll,
        )
        out(f"{placement.label(rank)} joined the run of {placement.label(0)}")
        seq = 0

        def check_node0() -> None:
            node0.poll()
            node0.check_alive()

        def next_command() -> dict | None:
            command = read_json(directory / "command.json")
            fresh = command and command.get("session") == session["session"] and command["seq"] > seq
            return command if fresh else None

        def watch() -> None:
            check_node0()
            command = next_command()
            if command is not None and command["action"] == "abort":
                raise LaunchError(f"{placement.label(0)} stopped the run: {command['message']}")

        while True:
            command = wait_until(
                next_command,
                timeout_s=timeout_s,
                on_timeout=lambda: (
                    f"{placement.label(0)} announced no next stage within {timeout_text(timeout_s)}"
                ),
                check=check_node0,
            )
            seq = command["seq"]
            if command["action"] == "finish":
                out(f"{placement.label(0)} finished the run")
                return
            if command["action"] == "abort":
                raise LaunchError(f"{placement.label(0)} stopped the run: {command['message']}")
            report = {"session": session["session"], "seq": seq}
            try:
                run_local(command["stage"], Path(command["spec"]), command["port"], watch)
            except LaunchError as err:
                write_json(directory / f"report{rank}.json", {**report, "ok": False, "message": str(err)})
                raise
            write_json(directory / f"report{rank}.json", {**report, "ok": True, "message": ""})
