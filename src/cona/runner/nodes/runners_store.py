"""The key-value store the runners of a multi-node run agree through: a ``torch.distributed.TCPStore``
hosted by node 0's runner, as torchrun's own rendezvous hosts one (the shared filesystem keeps the
checkpoints and the run directory; nothing the runners decide goes through it, so no agreement depends on
NFS attribute caching).

Node 0 listens on ``--master-port-base`` itself (stage N's torchrun uses base + N); the other runners
connect to ``--master-addr``. Values are JSON; a waiting runner asks the store whether its key is there
every :data:`POLL_S` (a round trip on an open connection, not a file poll), so that it can check meanwhile
that its peers are alive. Every store error becomes a :class:`LaunchError` saying whose runner is gone.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from cona.errors import LaunchError

HEARTBEAT_S = 1.0
POLL_S = 0.02
_CONNECT_PROBE_S = 0.2


def timeout_text(timeout_s: float) -> str:
    amount = f"{timeout_s / 60:g} min" if timeout_s >= 60 else f"{timeout_s:g} s"
    return f"{amount} (training.distributed_timeout_minutes)"


def store_port(base_port: int | None) -> int:
    """The port of the runners' store: the base itself (the stages use base + 1, base + 2, ...)."""
    if base_port is None or not 1024 <= base_port <= 65535:
        raise LaunchError(f"--master-port-base {base_port}: the runners' store needs a port in 1024..65535")
    return base_port


class RunnersStore:
    """One connection to the runners' store. ``gone`` says, for an error message, whose runner is gone when
    the store fails (node 0's for the other nodes: its runner hosts the store)."""

    def __init__(self, store: Any, *, addr: str, port: int, gone: str) -> None:
        self._store, self.addr, self.port, self._gone = store, addr, port, gone

    @classmethod
    def host(cls, addr: str, port: int, *, timeout_s: float, gone: str) -> RunnersStore:
        """Node 0: start the store (listening on every address of this machine) and connect to it."""
        from torch.distributed import TCPStore

        try:
            store = TCPStore(
                addr, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
            )
        except RuntimeError as err:
            raise LaunchError(
                f"the runners' store cannot listen on port {port} ({_first_line(err)}); choose another "
                f"--master-port-base (stage N uses base + N, the store the base itself)"
            ) from None
        return cls(store, addr=addr, port=port, gone=gone)

    @classmethod
    def connect(
        cls, addr: str, port: int, *, timeout_s: float, on_timeout: Callable[[], str], gone: str
    ) -> RunnersStore:
        """Another node: connect once node 0's store listens (before that, a plain socket probes it, as
        the store's own retries would log a warning each)."""
        from torch.distributed import TCPStore

        deadline = time.monotonic() + timeout_s
        while not _listening(addr, port):
            if time.monotonic() > deadline:
                raise LaunchError(f"{on_timeout()} (no runners' store at {addr}:{port})")
            time.sleep(_CONNECT_PROBE_S)
        try:
            store = TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=timeout_s))
        except RuntimeError as err:
            raise LaunchError(f"{on_timeout()} ({addr}:{port}: {_first_line(err)})") from None
        return cls(store, addr=addr, port=port, gone=gone)

    def another(self, *, timeout_s: float) -> RunnersStore:
        """A second connection to the same store, for a thread of its own (one connection serves one
        request at a time)."""
        from torch.distributed import TCPStore

        store = self._call(
            lambda: TCPStore(self.addr, self.port, is_master=False, timeout=timedelta(seconds=timeout_s))
        )
        return RunnersStore(store, addr=self.addr, port=self.port, gone=self._gone)

    def set_json(self, key: str, body: dict) -> None:
        self._call(lambda: self._store.set(key, json.dumps(body)))

    def get_json(self, key: str) -> dict | None:
        """The value of ``key``, or None while nobody set it."""
        if not self._call(lambda: self._store.check([key])):
            return None
        return json.loads(self._call(lambda: self._store.get(key)))

    def add(self, key: str, amount: int) -> int:
        """Add to a counter (0 reads it; a counter nobody added to reads 0)."""
        return int(self._call(lambda: self._store.add(key, amount)))

    def _call(self, operation: Callable[[], Any]) -> Any:
        try:
            return operation()
        except RuntimeError as err:  # torch's DistError and its subclasses
            raise LaunchError(
                f"{self._gone}: the runners' store at {self.addr}:{self.port} failed ({_first_line(err)})"
            ) from None


def wait_until(
    ready: Callable[[], Any], *, timeout_s: float, on_timeout: Callable[[], str], check: Callable[[], None]
) -> Any:
    """Ask ``ready()`` until it returns something truthy; ``check()`` may raise meanwhile."""
    deadline = time.monotonic() + timeout_s
    while True:
        check()
        value = ready()
        if value:
            return value
        if time.monotonic() > deadline:
            raise LaunchError(on_timeout())
        time.sleep(POLL_S)


class Heartbeat:
    """Adds 1 to the counter ``beat/<rank>`` every second from a thread (on a connection of its own),
    while the runner lives. A peer is alive while its counter moves: no clocks of different hosts are
    compared."""

    def __init__(self, store: RunnersStore, rank: int) -> None:
        self._store, self._key = store, f"beat/{rank}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True, name=f"cona-heartbeat-{rank}")

    def __enter__(self) -> Heartbeat:
        self._store.add(self._key, 1)
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._store.add(self._key, 1)
            except LaunchError:
                return  # the store is gone: the main thread finds out on its next request


class PeerWatch:
    """When each peer's heartbeat counter last moved, by this process's own clock (from the start of the
    watch: a peer that joined was alive then)."""

    def __init__(
        self, store: RunnersStore, ranks: Sequence[int], label: Callable[[int], str], timeout_s: float
    ) -> None:
        self._store, self._label, self.timeout_s = store, label, timeout_s
        now = time.monotonic()
        self._seen = {rank: (self._beats(rank), now) for rank in ranks}

    def _beats(self, rank: int) -> int:
        return self._store.add(f"beat/{rank}", 0)

    def check_alive(self) -> None:
        now = time.monotonic()
        for rank, (last, moved) in self._seen.items():
            current = self._beats(rank)
            if current != last:
                self._seen[rank] = (current, now)
            elif now - moved > self.timeout_s:
                raise LaunchError(
                    f"{self._label(rank)} stopped responding: its heartbeat in the runners' store has not "
                    f"moved for {now - moved:.0f} s; its runner is gone"
                )


def _listening(addr: str, port: int) -> bool:
    try:
        with socket.create_connection((addr, port), timeout=_CONNECT_PROBE_S):
            return True
    except OSError:
        return False


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]
