"""One run at a time on a run directory and on a checkpoint folder.

A runner holds an exclusive ``flock`` on ``.<name>.lock`` beside each directory it writes (its run
directory and the layout folders its checkpoints go to) for as long as the run lasts; a second run on any of
them is refused with one line naming the holder (pid, host, when it started), which the lock file records.
The kernel drops the lock with the last descriptor of its holder, so a killed run never blocks a rerun, and
no stale lock needs breaking. torchrun inherits the descriptors (:func:`held_fds`), so the lock also covers
the few seconds a killed runner's workers take to notice and stop: a rerun started at once is refused
instead of training beside them. Within one process, locks are taken in a :func:`run_locks` scope and
released when it ends.

``log_root`` and the workdir may be shared, so whoever can create a file there could plant one at a lock's
path: the lock file is opened without following a symbolic link, and is used only when it is a regular file
with one link that is empty or holds a holder record (a file CONA made); anything else is refused by name and
left as it is, so a run never overwrites a file it did not create.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from cona.errors import ConaError
from cona.processes import running

_scopes: list[dict[Path, int]] = []
"""The locks this process holds, one dict (lock file -> descriptor) per open :func:`run_locks` scope."""


class RunLocked(ConaError):
    """A run directory or checkpoint folder another live run holds."""


def lock_path(directory: Path) -> Path:
    """``<parent>/.<name>.lock``: beside the directory, where ``--fresh`` or a prune never meets it."""
    directory = Path(directory).resolve()
    return directory.parent / f".{directory.name}.lock"


@contextmanager
def run_locks() -> Iterator[None]:
    """A scope for :func:`lock_directory`: every lock taken inside it is released when it ends."""
    scope: dict[Path, int] = {}
    _scopes.append(scope)
    try:
        yield
    finally:
        _scopes.remove(scope)
        for fd in scope.values():
            fcntl.flock(fd, fcntl.LOCK_UN)  # also for the torchrun of a worker session that outlives it
            os.close(fd)


def lock_directory(directory: Path, what: str) -> None:
    """Hold ``directory``'s lock in the innermost :func:`run_locks` scope (nothing to do when this
    process holds it already, or outside any scope: a launcher used on its own); raises
    :class:`RunLocked` naming the holder when another process holds it."""
    path = lock_path(directory)
    if not _scopes or any(path in scope for scope in _scopes):
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, created = _open_lock_file(path, what, directory)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        holder = _read_holder(fd)
        os.close(fd)
        if err.errno not in (errno.EAGAIN, errno.EACCES):
            raise RunLocked(f"cannot lock {what} {directory} ({path}): {err.strerror}") from None
        raise RunLocked(f"{what} {directory} is in use by {holder}; wait for it to end or stop it") from None
    if not created and not _holds_a_holder_record(fd):
        os.close(fd)
        raise RunLocked(
            f"cannot lock {what} {directory}: its lock file {path} was not made by CONA (it holds other "
            "data); remove it if nothing needs it"
        )
    _write_holder(fd)
    _scopes[-1][path] = fd


def _open_lock_file(path: Path, what: str, directory: Path) -> tuple[int, bool]:
    """A read-write descriptor of the lock file and whether this call created it; raises
    :class:`RunLocked` when ``path`` is a symbolic link, not a regular file, or a regular file with more
    than one link (a hard link to another file)."""
    flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW
    for _ in range(3):  # the file may be removed between the two opens: create it again
        try:
            return os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644), True
        except FileExistsError:
            pass
        try:
            fd = os.open(path, flags | os.O_NONBLOCK)  # O_NONBLOCK: a planted FIFO must not block the open
        except FileNotFoundError:
            continue
        except OSError as err:
            reason = "it is a symbolic link" if err.errno == errno.ELOOP else err.strerror
            raise RunLocked(f"cannot lock {what} {directory}: lock file {path}: {reason}") from None
        info = os.fstat(fd)
        if stat.S_ISREG(info.st_mode) and info.st_nlink == 1:
            return fd, False
        os.close(fd)
        reason = "is not a regular file" if not stat.S_ISREG(info.st_mode) else "has other links"
        raise RunLocked(f"cannot lock {what} {directory}: lock file {path} {reason}")
    raise RunLocked(f"cannot lock {what} {directory}: lock file {path} keeps disappearing")


def _holds_a_holder_record(fd: int) -> bool:
    """Whether the lock file is empty or holds one holder record (what :func:`_write_holder` writes)."""
    if os.fstat(fd).st_size > 4096:
        return False
    text = os.pread(fd, 4096, 0)
    if not text:
        return True
    try:
        record = json.loads(text.decode())
    except (ValueError, UnicodeDecodeError):
        return False
    return isinstance(record, dict) and set(record) == {"pid", "host", "started"}


def locking() -> bool:
    """Whether a :func:`run_locks` scope is open (:func:`lock_directory` then locks)."""
    return bool(_scopes)


def held_fds() -> tuple[int, ...]:
    """The descriptors of every lock this process holds (for torchrun to inherit)."""
    return tuple(fd for scope in _scopes for fd in scope.values())


def popen_holding_locks(command: list[str], **options: Any) -> subprocess.Popen:
    """Start a launcher (torchrun, DeepSpeed's) that keeps this run's locks for as long as it lives: it
    inherits their descriptors, so a rerun is refused while it and its workers may still train or save,
    even after the runner was killed."""
    return subprocess.Popen(command, pass_fds=held_fds(), **options)


def _write_holder(fd: int) -> None:
    record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)


def _read_holder(fd: int) -> str:
    """The holder as one phrase: ``pid P on host H (since T)``, or its workers once P itself is gone."""
    try:
        record = json.loads(os.pread(fd, 4096, 0).decode())
        pid, host, started = int(record["pid"]), str(record["host"]), float(record["started"])
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError):
        return "another process (its lock file records no holder)"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))
    holder = f"pid {pid} on host {host} (since {since})"
    if host == socket.gethostname() and not running(pid):
        return f"the workers of {holder}, which is gone (they stop within seconds)"
    return holder
