"""How the runners of a multi-node run agree on every stage boundary: keys in the runners' store.

**Agreement.** Every node runs the same command. Node 0's runner hosts a ``torch.distributed.TCPStore``
(:mod:`cona.runner.nodes.runners_store`) on ``--master-port-base``; the others connect to it at
``--master-addr``.
The keys:

- ``joined/<r>``: node r's runner connected (a counter: a second runner with the same node rank is refused).
- ``session``: node 0, once every node joined.
- ``beat/<r>``: a counter each runner adds to every second; a node is alive while it moves.
- ``command/<seq>``: node 0's decision number seq: run stage N (spec, port), ``finish``, or ``abort`` (with
  why).
- ``report/<seq>/<r>``: node r's runner, after its torchrun exited: left the stage ok, or failed (with why).
- ``left/<r>``: node r's runner read the last command or gave up; node 0 keeps the store up until then.

Node 0 alone plans, keeps the run state and publishes, and only after every node reported leaving the stage
successfully. Every wait ends after ``training.distributed_timeout_minutes`` with an error naming the node
that did not arrive.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cona.errors import LaunchError
from cona.runner.nodes.multinode import NodePlacement
from cona.runner.nodes.runners_store import Heartbeat, PeerWatch, RunnersStore, timeout_text, wait_until

if TYPE_CHECKING:
    from cona.runner.nodes.multinode import RemoteRunners

ABORT_GRACE_S = 5.0
"""How long node 0, stopping the run, keeps the store up for the other nodes to read why."""

LocalStage = Callable[[Callable[[], None]], None]
"""Runs this node's torchrun for a stage; calls the given ``watch`` while it waits (``watch`` may raise)."""


class Coordinator:
    """Node 0's side: hosts the store, gathers the nodes, announces each stage, and waits for every node to
    leave it."""

    def __init__(
        self,
        placement: NodePlacement,
        *,
        port: int,
        timeout_s: float,
        out: Callable[[str], None],
        remote: RemoteRunners | None = None,
    ) -> None:
        self.placement, self.port, self.timeout_s = placement, port, timeout_s
        self.out, self.remote = out, remote
        self.peers = range(1, placement.num_nodes)
        self._store: RunnersStore | None = None
        self._heartbeat: Heartbeat | None = None
        self._watch: PeerWatch | None = None
        self._seq = 0

    @property
    def store(self) -> RunnersStore:
        assert self._store is not None, "the coordinator is used outside its with block"
        return self._store

    def __enter__(self) -> Coordinator:
        label = self.placement.label(0)
        self._store = RunnersStore.host(
            self.placement.master_addr, self.port, timeout_s=self.timeout_s, gone=label
        )
        try:
            self._heartbeat = Heartbeat(self.store.another(timeout_s=self.timeout_s), 0).__enter__()
            if self.remote is not None:
                self.remote.start()
            self._join()
        except BaseException as err:
            self.__exit__(type(err), err, None)
            raise
        return self

    def __exit__(self, kind: type | None, err: BaseException | None, _tb: object) -> None:
        try:
            if self._watch is not None:  # the nodes joined: tell them how the run ends
                self._tell_the_end(err)
            if self.remote is not None:
                self.remote.stop(wait_s=self.timeout_s if err is None else 10.0)
        finally:
            if self._heartbeat is not None:
                self._heartbeat.__exit__()
            self._store = self._heartbeat = self._watch = None  # the store stops with its last reference

    def _tell_the_end(self, err: BaseException | None) -> None:
        try:
            if err is None:
                self._command(action="finish")
            else:
                self._command(action="abort", message=str(err) or type(err).__name__)
            wait_until(
                lambda: all(self.store.add(f"left/{rank}", 0) for rank in self.peers),
                timeout_s=self.timeout_s if err is None else min(ABORT_GRACE_S, self.timeout_s),
                on_timeout=lambda: "",
                check=lambda: None,
            )
        except LaunchError:
            pass  # a node that does not read the end stops on its own timeout, or on the store going away

    def _join(self) -> None:
        def missing() -> list[int]:
            return [rank for rank in self.peers if self.store.add(f"joined/{rank}", 0) == 0]

        wait_until(
            lambda: not missing(),
            timeout_s=self.timeout_s,
            on_timeout=lambda: (
                f"{', '.join(self.placement.label(r) for r in missing())} did not start within "
                f"{timeout_text(self.timeout_s)}: it did not join the runners' store on port {self.port}; "
                f"run the same command there with its --node-rank"
            ),
            check=self._check_remote,
        )
        self._watch = PeerWatch(self.store, self.peers, self.placement.label, self.timeout_s)
        self.store.set_json("session", {"nodes": self.placement.num_nodes})
        self.out(f"all {self.placement.num_nodes} nodes joined: {', '.join(self.placement.hosts)}")

    def _command(self, **body: Any) -> None:
        self._seq += 1
        self.store.set_json(f"command/{self._seq}", body)

    def _check_remote(self) -> None:
        if self.remote is not None:
            self.remote.check()

    def run_stage(self, stage: int, spec_path: Path, port: int, run_local: LocalStage) -> None:
        """Announce the stage, run this node's part, and return once every node left it successfully."""
        self._command(action="stage", stage=stage, spec=str(spec_path), port=port)
        seq = self._seq

        def watch() -> None:
            self._raise_failed_report(stage, seq)
            assert self._watch is not None
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
        return self.store.get_json(f"report/{seq}/{rank}")

    def _unreported(self, seq: int) -> list[int]:
        return [rank for rank in self.peers if self._report(rank, seq) is None]

    def _raise_failed_report(self, stage: int, seq: int) -> None:
        for rank in self.peers:
            report = self._report(rank, seq)
            if report is not None and not report["ok"]:
                raise LaunchError(f"stage {stage}: {self.placement.label(rank)} failed: {report['message']}")

    def _peer_notes(self, seq: int) -> str:
        notes = []
        try:
            for rank in self.peers:
                report = self._report(rank, seq)
                if report is None:
                    notes.append(f"{self.placement.label(rank)} has not reported leaving the stage")
                elif not report["ok"]:
                    notes.append(f"{self.placement.label(rank)} failed: {report['message']}")
        except LaunchError:
            pass  # the store failed too: the stage's own error is the one to report
        return f" [{'; '.join(notes)}]" if notes else ""


FollowerStage = Callable[[int, Path, int, Callable[[], None]], None]
"""Runs this node's torchrun for (stage, spec path, master port), calling ``watch`` while it waits."""


def follow(
    placement: NodePlacement,
    *,
    port: int,
    timeout_s: float,
    run_local: FollowerStage,
    out: Callable[[str], None],
) -> None:
    """Node r > 0: join node 0's store, run every stage it announces, report leaving each one."""
    rank, node0 = placement.node_rank, placement.label(0)

    def not_gathered() -> str:
        return f"{node0} did not gather the nodes within {timeout_text(timeout_s)}"

    gone = f"{node0} stopped responding"
    store = RunnersStore.connect(
        placement.master_addr, port, timeout_s=timeout_s, on_timeout=not_gathered, gone=gone
    )
    if store.add(f"joined/{rank}", 1) > 1:
        raise LaunchError(f"{placement.label(rank)}: another runner already joined with --node-rank {rank}")
    try:
        with Heartbeat(store.another(timeout_s=timeout_s), rank):
            node0_watch = PeerWatch(store, [0], placement.label, timeout_s)
            wait_until(
                lambda: store.get_json("session"),
                timeout_s=timeout_s,
                on_timeout=not_gathered,
                check=node0_watch.check_alive,
            )
            out(f"{placement.label(rank)} joined the run of {node0}")
            _follow_commands(store, placement, node0_watch, timeout_s=timeout_s, run_local=run_local, out=out)
    finally:
        with contextlib.suppress(LaunchError):  # node 0's store is gone already: nobody waits for us
            store.add(f"left/{rank}", 1)


def _follow_commands(
    store: RunnersStore,
    placement: NodePlacement,
    node0_watch: PeerWatch,
    *,
    timeout_s: float,
    run_local: FollowerStage,
    out: Callable[[str], None],
) -> None:
    rank, node0 = placement.node_rank, placement.label(0)
    seq = 0

    def next_command() -> dict | None:
        return store.get_json(f"command/{seq + 1}")

    def watch() -> None:
        node0_watch.check_alive()
        command = next_command()
        if command is not None and command["action"] == "abort":
            raise LaunchError(f"{node0} stopped the run: {command['message']}")

    while True:
        command = wait_until(
            next_command,
            timeout_s=timeout_s,
            on_timeout=lambda: f"{node0} announced no next stage within {timeout_text(timeout_s)}",
            check=node0_watch.check_alive,
        )
        seq += 1
        if command["action"] == "finish":
            out(f"{node0} finished the run")
            return
        if command["action"] == "abort":
            raise LaunchError(f"{node0} stopped the run: {command['message']}")
        try:
            run_local(command["stage"], Path(command["spec"]), command["port"], watch)
        except LaunchError as err:
            _report(store, f"report/{seq}/{rank}", ok=False, message=str(err))
            raise
        _report(store, f"report/{seq}/{rank}", ok=True, message="")


def _report(store: RunnersStore, key: str, *, ok: bool, message: str) -> None:
    try:
        store.set_json(key, {"ok": ok, "message": message})
    except LaunchError:
        if ok:
            raise
        # failing anyway: the stage's own error says more than the store's
