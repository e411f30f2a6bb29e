"""SIGTERM, SIGINT and SIGHUP of a runner: stop its workers and leave the run resumable.

SIGHUP comes when the terminal or the SSH session that started the runner goes away; left to its default it
kills the runner outright, with no word and its workers left to notice alone, so it is handled as SIGTERM.
Under :func:`stop_on_signals` each of these signals raises :class:`RunStopped` (a ``KeyboardInterrupt``) in
the runner wherever it is; the launchers stop torchrun on the way out (it stops its workers), nothing marks
the run's state, so ``runner_state.json`` stays as the last transition left it and the same command resumes
from the last complete checkpoint. ``cona`` prints the one line and exits ``128 + signal``.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

RESUME_HINT = "the workers were stopped; the same command resumes the run from its last checkpoint"


class RunStopped(KeyboardInterrupt):
    """The runner got SIGTERM, SIGINT or SIGHUP; ``exit_code`` is ``128 + signal``."""

    def __init__(self, signum: int) -> None:
        name = signal.Signals(signum).name
        super().__init__(f"stopped by {name}: {RESUME_HINT}")
        self.exit_code = 128 + signum


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within the block, the first SIGTERM, SIGINT or SIGHUP raises :class:`RunStopped`; a repeated one is
    ignored meanwhile, so that stopping the workers is not cut short. The previous handlers come back
    after."""
    watched = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    previous = {signum: signal.getsignal(signum) for signum in watched}

    def stop(signum: int, frame: FrameType | None) -> None:
        for other in watched:
            signal.signal(other, signal.SIG_IGN)
        raise RunStopped(signum)

    for signum in watched:
        signal.signal(signum, stop)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
