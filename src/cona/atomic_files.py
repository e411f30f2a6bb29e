"""The one way CONA replaces a file that another process may read at any moment: write a temporary file in
the same directory, flush and fsync it, rename it over the target, fsync the directory.

A reader (a worker polling ``switch_request.json``, ``cona status``, a resumed run reading
``runner_state.json``) then sees the old file or the new one, never half of one; the two fsyncs make the same
hold after a power loss (without them a journaling filesystem may keep the rename but not the bytes). The
temporary's name is private to the writer (a process id and a random part), so several processes writing the
same file at once never write into each other's temporary.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

_NO_DIRECTORY_FSYNC = (errno.EINVAL, errno.ENOTSUP, errno.EBADF, errno.EACCES, errno.EPERM, errno.EISDIR)
"""Where a filesystem cannot fsync a directory (some network filesystems), the rename is as durable as it
gets; that is not an error."""


def fsync_dir(directory: Path) -> None:
    """Make the entries of ``directory`` (a rename into it) durable."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as err:
        if err.errno in _NO_DIRECTORY_FSYNC:
            return
        raise
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in _NO_DIRECTORY_FSYNC:
            raise
    finally:
        os.close(fd)


def private_tmp(path: Path) -> Path:
    """``.<name>.<pid>-<random>.tmp`` beside ``path``: hidden, and no other writer's."""
    return path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(3)}.tmp")


@contextlib.contextmanager
def atomic_open(path: Path, mode: str = "w", *, tmp: Path | None = None) -> Iterator[IO[Any]]:
    """Open a temporary for writing; on a clean exit it is fsynced and renamed over ``path`` (and the
    directory fsynced), on an exception removed. ``tmp`` names the temporary where a caller's clean-up
    must recognise it (the checkpoint layout's ``.tmp-*`` entries). An ``OSError`` that names no file (a
    write or fsync on a full disk) is raised again naming ``path``, so the CLI reports it in one line."""
    path = Path(path)
    tmp = private_tmp(path) if tmp is None else Path(tmp)
    try:
        with open(tmp, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if isinstance(err, OSError) and err.filename is None:  # a write or fsync (a full disk): name the file
            raise OSError(err.errno, err.strerror or str(err), str(path)) from err
        raise
    fsync_dir(path.parent)


def write_atomic(path: Path, data: str | bytes, *, tmp: Path | None = None) -> Path:
    """Replace ``path`` with ``data`` (text is written as UTF-8); returns ``path``."""
    with atomic_open(path, "wb" if isinstance(data, bytes) else "w", tmp=tmp) as handle:
        handle.write(data)
    return Path(path)


def write_json_atomic(path: Path, document: Any, *, indent: int | None = 1, sort_keys: bool = False) -> Path:
    """Replace ``path`` with ``document`` as JSON and a final newline; returns ``path``."""
    return write_atomic(path, json.dumps(document, indent=indent, sort_keys=sort_keys) + "\n")


def current_umask() -> int:
    """The process's file mode creation mask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def give_umask_mode(path: Path) -> Path:
    """Give ``path`` the mode a plain ``open`` would have given it (0666 less the umask): writers that
    create their file 0600 (safetensors) would otherwise keep an export from the user's group."""
    os.chmod(path, 0o666 & ~current_umask())
    return Path(path)
