"""The stage worker (:mod:`cona.engine.worker`) that brings the runner, torchrun and itself down by SIGKILL
in the middle of one stage's final save: after every rank wrote its shards and rank 0 the JSON files, just
before the temporary directory is renamed into place (so before ``latest`` and before the runner can
publish it).

It kills torchrun's process group (the runner's: torchrun inherits it), then itself (torchrun starts each
worker in a session of its own): the runner, torchrun and this rank die at once, as on a power loss; the
other ranks, waiting for this one in the save's last barrier, fail on the lost connection and exit. The
stage to kill is ``CONA_TEST_KILL_IN_SAVE_OF_STAGE``; the kill hits the save of that stage's target
iteration (the one that hands off to the next stage).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from cona.engine import worker
from cona.engine.checkpoint import save as checkpoint
from cona.engine.spec import StageSpec

KILL_STAGE_ENV = "CONA_TEST_KILL_IN_SAVE_OF_STAGE"


def main() -> None:
    spec = StageSpec.read(Path(sys.argv[1]))
    if spec.stage == int(os.environ[KILL_STAGE_ENV]):
        final_name = f"global_step{spec.target_iteration}"
        rename_into_place = checkpoint._publish

        def die_before_rename(tmp_dir: Path, final_dir: Path) -> None:
            if final_dir.name == final_name:
                os.killpg(os.getpgid(os.getppid()), signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)
            rename_into_place(tmp_dir, final_dir)

        checkpoint._publish = die_before_rename
    worker.main()


if __name__ == "__main__":
    main()
