"""Where a chain starts: from scratch, or from a given checkpoint its initial step loads (``load_checkpoint``:
another run's, to continue or fine-tune it), at that checkpoint's iteration and consumed samples."""

from __future__ import annotations

from pathlib import Path

from cona.engine.checkpoint.info import read_checkpoint_info, resolve_checkpoint
from cona.errors import ChainError, CheckpointError


def start_point(loads: list[str | None], workdir: Path, where: str) -> tuple[Path | None, int, int]:
    """The checkpoint, iteration and consumed tokens the chain starts from, given each step's
    ``load_checkpoint`` (only the first may have one; a relative path is relative to the workdir)."""
    for number, given in enumerate(loads[1:], start=2):
        if given is not None:
            raise ChainError(
                f"{where}: step {number}: load_checkpoint: only the initial step loads a given checkpoint "
                "(the others load the previous step's)"
            )
    if loads[0] is None:
        return None, 0, 0
    path = Path(loads[0]) if Path(loads[0]).is_absolute() else Path(workdir) / loads[0]
    try:
        checkpoint = resolve_checkpoint(path)
        state = read_checkpoint_info(checkpoint).trainer_state
    except CheckpointError as err:
        raise ChainError(f"{where}: step 1: load_checkpoint: {err}") from None
    return checkpoint, int(state.get("iteration", 0)), int(state.get("consumed_tokens", 0))
