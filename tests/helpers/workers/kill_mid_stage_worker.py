"""The stage worker (:mod:`cona.engine.worker`) that brings the runner, torchrun and itself down by SIGKILL
in the middle of one stage, once a periodic checkpoint of that stage is published: rank 0 kills at the first
step boundary at or after iteration ``CONA_TEST_KILL_AT_ITERATION`` where
``global_step<CONA_TEST_KILL_ONCE_SAVED>`` is in the stage's layout directory (a later periodic save may
still be in flight: its temporary is left).

As in :mod:`kill_in_save_worker`, it kills torchrun's process group (the runner's), then itself; the other
ranks fail on the lost connection and exit. The stage to kill is ``CONA_TEST_KILL_STAGE``.
"""

from __future__ import annotations

import os
import signal

import torch.distributed as dist

from cona.engine import trainer, worker

KILL_STAGE_ENV = "CONA_TEST_KILL_STAGE"
KILL_AT_ENV = "CONA_TEST_KILL_AT_ITERATION"
ONCE_SAVED_ENV = "CONA_TEST_KILL_ONCE_SAVED"


def main() -> None:
    stage = int(os.environ[KILL_STAGE_ENV])
    kill_at, saved = int(os.environ[KILL_AT_ENV]), f"global_step{os.environ[ONCE_SAVED_ENV]}"
    periodic_save = trainer._periodic_save

    def save_then_maybe_die(saves, progress, boundary, *, ending):  # also in a session's later stages
        waited = periodic_save(saves, progress, boundary, ending=ending)
        published = saves is not None and saves.stage == stage and (saves.layout_dir / saved).is_dir()
        if dist.get_rank() == 0 and progress.iteration >= kill_at and published:
            os.killpg(os.getpgid(os.getppid()), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        return waited

    trainer._periodic_save = save_then_maybe_die
    worker.main()


if __name__ == "__main__":
    main()
