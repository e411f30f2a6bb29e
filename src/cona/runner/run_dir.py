"""The run directory ``<log_root>/<run_name>/`` and the ``<log_root>/latest`` pointer to it.

Making them (a new run's directory refused when it exists, a stage's directory, the ``latest`` pointer: a
symlink, or a text file naming the run where symlinks are not available); the names of the files inside are
:mod:`cona.run_files`'s.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

from cona import run_files
from cona.atomic_files import fsync_dir
from cona.config import ConaConfig
from cona.errors import LaunchError

LATEST_NAME = run_files.LATEST
_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=-]*")


def check_run_name(name: str) -> str:
    if not _RUN_NAME.fullmatch(name) or name == LATEST_NAME:
        raise LaunchError(
            f"--run-name {name!r}: use letters, digits and . _ + = - (not starting with one of "
            f"those symbols), and not '{LATEST_NAME}'"
        )
    return name


def resolve_log_root(config: ConaConfig) -> ConaConfig:
    """The config with ``training.log_root`` absolute. A relative value (the default ``logs`` is left
    relative by the config loader) is taken relative to the config file's directory, as every other path
    of a .conaconfig is, so a run's logs do not depend on the directory it was started from."""
    log_root = Path(config.training.logging.log_root)
    if not log_root.is_absolute():
        base = config.path.parent if config.path is not None else Path.cwd()
        log_root = (base / log_root).resolve()
    return dataclasses.replace(config, training=config.training.replace(log_root=str(log_root)))


def create_run_dir(log_root: Path, run_name: str) -> Path:
    """Make ``<log_root>/<run_name>/`` (refusing one that exists, so two runs never mix their metrics)
    and point ``<log_root>/latest`` at it."""
    run_dir = Path(log_root).resolve() / check_run_name(run_name)
    try:
        run_dir.mkdir(parents=True, exist_ok=False)
    except FileExistsError:
        raise LaunchError(f"run directory {run_dir} already exists; pick another --run-name") from None
    except OSError as err:
        raise LaunchError(f"cannot create run directory {run_dir}: {err.strerror}") from None
    point_latest(run_dir)
    return run_dir


def stage_dir(run_dir: Path, stage: int) -> Path:
    """``<run_dir>/stages/<stage>/``, created if missing."""
    path = run_files.stage_path(run_dir, stage)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise LaunchError(f"cannot create {path}: {err.strerror or err}") from None
    return path


def check_workdir(workdir: Path, flag: str = "--workdir") -> Path:
    """``workdir`` made absolute, refused (before anything trains) when it or a parent is not a directory,
    or its links loop: checkpoints are written under it, and a file there would surface only at the first
    save."""
    try:
        workdir = Path(workdir).expanduser().resolve()
    except (RuntimeError, OSError):  # pathlib raises RuntimeError for a symlink loop (OSError ELOOP on 3.13)
        raise LaunchError(f"{flag} {workdir}: a symbolic link loop; checkpoints need a directory") from None
    for path in (workdir, *workdir.parents):
        if path.exists():
            if not path.is_dir():
                what = "is a file" if path == workdir else f"is inside {path}, which is a file"
                raise LaunchError(f"{flag} {workdir} {what}; checkpoints need a directory")
            break
    return workdir


def point_latest(run_dir: Path) -> Path:
    """Make ``<log_root>/latest`` name ``run_dir``: a relative symlink swapped in atomically, or, where
    symlinks cannot be made, a text file holding the run directory's name."""
    latest = run_dir.parent / LATEST_NAME
    tmp = run_dir.parent / f".{LATEST_NAME}.{os.getpid()}"
    try:
        tmp.unlink(missing_ok=True)
        try:
            tmp.symlink_to(run_dir.name, target_is_directory=True)
        except OSError:
            tmp.write_text(run_dir.name + "\n")
        if latest.is_dir() and not latest.is_symlink():
            tmp.unlink()
            raise LaunchError(
                f"{latest} is a real directory; it is reserved for the pointer to the newest run"
            )
        tmp.replace(latest)
        fsync_dir(latest.parent)
    except OSError as err:  # a full disk or a read-only log_root: one line, not the chain of both attempts
        raise LaunchError(f"cannot write {latest}: {err.strerror or err}") from None
    return latest


def resolve_latest(log_root: Path) -> Path:
    """The run directory ``<log_root>/latest`` names (symlink or marker file)."""
    latest = Path(log_root) / LATEST_NAME
    if latest.is_symlink():
        return latest.resolve()
    if latest.is_file():
        return (Path(log_root) / latest.read_text().strip()).resolve()
    raise LaunchError(f"no run under {log_root}: {latest} does not exist")
