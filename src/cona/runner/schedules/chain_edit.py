"""A chain file edited after its run started: the steps not started yet may change, the others may not.

The run state records the digest of every step as it was when the run started (and after each accepted
edit). Rerunning with an edited file continues the run when every step that already started (running or
further) is the same: steps after them are taken from the file as it is now (changed, added or removed),
and the run state is rewritten for them. A change to a step that already ran is refused, naming the step;
``--fresh`` starts over or another ``--run-name`` starts a separate run.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from cona.errors import ChainError
from cona.runner.chain_file import ChainConfig
from cona.runner.state import RunState, StageState, save_state


def continue_edited(state: RunState, chain: ChainConfig, run_dir: Path) -> tuple[RunState, str | None]:
    """The run state under ``chain`` (saved when it changed), and a line saying what the edit changed (None:
    the chain is as the run started it). Raises :class:`ChainError` for a change to a step that started."""
    if state.chain_digest == chain.digest:
        return state, None
    if not state.step_digests:
        return state, None  # a run state older than per-step digests: check_same_run refuses any change
    started = tuple(stage for stage in state.stages if stage.status != "pending")
    for stage in started:
        number = stage.step_num
        ran = "ran" if stage.status != "running" else "started"
        if number > len(chain.steps):
            raise ChainError(_refusal(run_dir, f"step {number} is gone from {chain.origin}, but it {ran}"))
        if chain.step_digests[number - 1] != state.step_digests[number - 1]:
            raise ChainError(_refusal(run_dir, f"step {number} of {chain.origin} changed after it {ran}"))
    pending = tuple(StageState(step_num=number) for number in range(len(started) + 1, len(chain.steps) + 1))
    edited = dataclasses.replace(
        state,
        chain_path=chain.origin,
        chain_digest=chain.digest,
        step_digests=chain.step_digests,
        stages=started + pending,
    )
    save_state(run_dir, edited)
    first = len(started) + 1
    steps = f"steps {first}..{len(chain.steps)}" if first < len(chain.steps) else f"step {first}"
    what = f"{steps} as the file now says" if pending else f"no step after step {len(started)}"
    return edited, f"chain {chain.origin} edited after step {len(started)} started: {what}"


def _refusal(run_dir: Path, why: str) -> str:
    return (
        f"run directory {run_dir}: {why}; only steps not yet started may change (pass --fresh to start over, "
        f"or choose another --run-name)"
    )
