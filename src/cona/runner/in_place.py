"""After a kill, rebuild the state an in-place switch kept only in the workers' memory.

An in-place switch writes no checkpoint: the next stage continues the model, optimizer and data the
session's workers hold. When a kill loses them, the same command retrains from the last stage whose start is
on disk, each stage up to the iteration it handed over at, under its own strategy and LR (so the same
samples in the same order, see :mod:`cona.engine.step_trace`), each handing its state to the next again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from cona import run_files
from cona.engine.spec import StageResult, StageSpec
from cona.errors import LaunchError
from cona.runner.state import RunState, StageState


def replay_in_place(
    state: RunState,
    step_num: int,
    *,
    continues_in_place: Callable[[int], bool],
    spec_of: Callable[[StageState], StageSpec],
    launch: Callable[[StageSpec, Path, int], None],
    out: Callable[[str], None],
) -> None:
    """Leave in the session's workers the state stage ``step_num`` continues in place
    (``continues_in_place(n)``: whether stage n continued the state of stage n - 1 in memory)."""
    first = step_num - 1
    while continues_in_place(first):
        first -= 1
    for number in range(first, step_num):
        stage = state.stage(number)
        spec = dataclasses.replace(
            spec_of(dataclasses.replace(stage, attempts=0)),  # attempts 0: not its own later checkpoint
            load_path=Path(stage.load_path) if number == first and stage.load_path else None,
            continue_in_place=number > first,
            start_iteration=stage.start_iteration if number > first else None,
            target_iteration=stage.last_iteration,
            max_tokens=None,
            save_at_end=False,
            save_interval=None,  # its state is rebuilt, not new: nothing to keep of it
            save_interval_minutes=None,
            hand_over_in_place=True,
            retraining=True,
        )
        out(
            f"stage {number}: retraining iterations {stage.start_iteration}..{stage.last_iteration} to "
            f"rebuild the state an in-place switch kept in memory"
        )
        spec_path = spec.write(spec.stage_dir / run_files.REPLAY_SPEC)
        spec.result_path.unlink(missing_ok=True)
        # A request left by the killed run (its stage was recorded, or never ended) would stop the
        # retraining at its first step: a retraining ends where the stage ended, on no request.
        spec.switch_request_path.unlink(missing_ok=True)
        launch(spec, spec_path, number)
        result = StageResult.read(spec.result_path)
        if not result.handed_over or result.last_iteration != stage.last_iteration:
            raise LaunchError(f"stage {number}: the retraining did not end at {stage.last_iteration}")
