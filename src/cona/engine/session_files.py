"""The files of a session's protocol (:mod:`cona.engine.session`), named in one place for both sides: the
workers and the runner (:mod:`cona.runner.worker_session`), which imports no torch."""

from __future__ import annotations

from pathlib import Path

SESSION_FLAG = "--session"
"""The worker's flag that makes it a session worker: ``python -m cona.engine.worker SPEC --session DIR``."""


def done_marker(session_dir: Path, number: int) -> Path:
    """Written by rank 0 when the session's ``number``-th stage (from 1) finished and its objects are gone."""
    return session_dir / f"done-{number}.json"


def next_command(session_dir: Path, number: int) -> Path:
    """The runner's command for the session's ``number``-th stage (``{"stop": true}`` ends the session)."""
    return session_dir / f"next-{number}.json"
