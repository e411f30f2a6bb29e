"""Where a run's checkpoints live: the one owner of the checkpoint folder names (temporaries' too).

A run is identified by its workdir and its name (the run directory's name), so its checkpoints go to
``<workdir>/checkpoints/<run_name>/``, one layout folder per (model, ZeRO stage, dtype, dp/tp/pp) below it:
two runs in one workdir never write into each other's folders, whatever their layouts. A layout folder
holds ``global_step<N>/`` checkpoints, their ``*_universal`` copies and the ``latest`` /
``latest_universal`` markers (:mod:`cona.engine.checkpoint`). A save writes into ``.tmp-*`` folders that end
in ``-of-<owner>`` (:func:`tmp_owner`), so that a run only ever cleans up its own.

cona versions before the run name was part of the path kept every run's checkpoints of one layout in one
shared folder, ``<workdir>/checkpoints/<model.name>/...`` (:func:`legacy_layout_dir`); a run they started
resumes from what it saved there (:func:`resume_folders`), and a chain file's pruning entry names a layout
that way (``ckpt_dir``, as the seed's chain files write it).
"""

from __future__ import annotations

import hashlib
import json
import secrets
from pathlib import Path

from cona.config import ConaConfig
from cona.engine.checkpoint.files import TRAINER_STATE_FILE
from cona.strategy import Strategy

CHECKPOINTS = "checkpoints"
"""The folder under the workdir that holds every run's checkpoints."""
RUN_KEY = "run"
"""The trainer_state key naming the run that saved a checkpoint (:func:`tmp_owner` of its run directory)."""
TMP_PREFIX = ".tmp-"
OWNER_TAG = "-of-"
OWNER_CHARS = 12


def run_checkpoints(workdir: Path, run_name: str) -> Path:
    """``<workdir>/checkpoints/<run_name>``: every checkpoint of one run."""
    return Path(workdir, CHECKPOINTS, run_name)


def layout_name(config: ConaConfig, strategy: Strategy, dtype: str) -> Path:
    """``<model.name>/z<zero_stage>/<dtype>/tp<tp>_pp<pp>_dp<dp>_sp1``: one layout's folder, relative."""
    return Path(config.model.name, f"z{strategy.zero_stage}", dtype, strategy.layout)


def layout_dir(workdir: Path, config: ConaConfig, strategy: Strategy, dtype: str, *, run_name: str) -> Path:
    """``<workdir>/checkpoints/<run_name>/<model.name>/z<zero_stage>/<dtype>/tp<tp>_pp<pp>_dp<dp>_sp1``:
    where run ``run_name`` saves (and looks for) its checkpoints of this layout."""
    return run_checkpoints(workdir, run_name) / layout_name(config, strategy, dtype)


def legacy_layout_dir(workdir: Path, config: ConaConfig, strategy: Strategy, dtype: str) -> Path:
    """``<workdir>/checkpoints/<model.name>/z<zero_stage>/<dtype>/...``: the folder of this layout that
    older cona versions shared between every run of the workdir."""
    return Path(workdir, CHECKPOINTS) / layout_name(config, strategy, dtype)


def resume_folders(
    workdir: Path, config: ConaConfig, strategy: Strategy, dtype: str, *, run_name: str
) -> tuple[Path, Path]:
    """Where a relaunched stage looks for the checkpoints it saved itself, in this order: the run's own
    layout folder, then the shared one of older versions (a run they started and this version resumes;
    the checkpoint's trainer_state still has to name the run and the stage)."""
    return (
        layout_dir(workdir, config, strategy, dtype, run_name=run_name),
        legacy_layout_dir(workdir, config, strategy, dtype),
    )


def tmp_owner(run_dir: Path) -> str:
    """The owner tag of a run's checkpoint temporaries: a digest of its resolved run directory."""
    return hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:OWNER_CHARS]


def tmp_name(kind: str, owner: str) -> str:
    """``.tmp-<kind>-<random>``, with ``-of-<owner>`` when the save has an owner."""
    return f"{TMP_PREFIX}{kind}-{secrets.token_hex(4)}" + (f"{OWNER_TAG}{owner}" if owner else "")


def is_own_tmp(name: str, owner: str) -> bool:
    if not name.startswith(TMP_PREFIX):
        return False
    return name.endswith(f"{OWNER_TAG}{owner}") if owner else OWNER_TAG not in name


def another_runs_checkpoint(final_dir: Path, owner: str) -> str | None:
    """Why ``final_dir`` may not be replaced by run ``owner`` (None: it may): its trainer_state names
    another run."""
    try:
        saved = json.loads((final_dir / TRAINER_STATE_FILE).read_text()).get(RUN_KEY) if owner else None
    except (OSError, ValueError, AttributeError):
        return None  # none there, or not a complete checkpoint of any run
    if not isinstance(saved, str) or saved == owner:
        return None
    return (
        f"{final_dir} is another run's checkpoint (its trainer_state.json names run {saved}, a run of the "
        f"same name under another log_root); refusing to replace it: give this run another --run-name or "
        f"a --workdir of its own"
    )
