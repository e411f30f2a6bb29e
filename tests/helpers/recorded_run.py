"""The recorded run directory (:data:`tests.helpers.paths.RUN_CHAIN_SMALL`) in the states the tests need."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

from tests.helpers.paths import RUN_CHAIN_SMALL

from cona.runner.state import load_state, save_state


def running_copy(tmp_path: Path) -> Path:
    """The fixture made to look as if stage 3 were still running."""
    run_dir = Path(shutil.copytree(RUN_CHAIN_SMALL, tmp_path / "run_chain_small")).resolve()
    state = load_state(run_dir)
    save_state(run_dir, state.with_stage(dataclasses.replace(state.stage(3), status="running")))
    (run_dir / "stages" / "3" / "stage_result.json").unlink()
    return run_dir
