"""Between stages: DeepSpeed's ``ds_to_universal`` and the repair of what it gets wrong for
Megatron-DeepSpeed.

``publish`` converts ``<layout>/global_step<N>`` into ``<layout>/global_step<N>_universal`` (assembled under
``..._universal.tmp`` and renamed into place, the ``latest_universal`` marker written last, so a kill at any
point
leaves either no universal copy or a complete, repaired one; rerunning finishes the job), then repairs:

- Defect A: Megatron-DeepSpeed records its row-parallel patterns only when the saving run had tp > 1, so a
  checkpoint saved at tp=1 gets ``cat_dim: 0`` for the row-parallel weights (``self_attention.dense.weight``,
  ``mlp.dense_4h_to_h.weight``). A later tp>1 load then slices them on the wrong dimension, silently (the
  element
  count matches). The repair rewrites ``cat_dim: 1`` in their ``fp32.pt``, ``exp_avg.pt`` and
  ``exp_avg_sq.pt``.
- Defect B (blocked fused QKV since commit 676a482c, see :mod:`.environment`) cannot be repaired here: a
chain that
  changes tp on such a checkout is refused up front by :func:`check_reshardable`.
- Defect C (tp-dependent vocabulary padding) is avoided by the padding divisor of :mod:`.commands`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from cona.atomic_files import write_json_atomic
from cona.backends.megatron_deepspeed.environment import MdsEnvironment, qkv_layout
from cona.engine.checkpoint.info import LATEST_UNIVERSAL
from cona.errors import ChainError, CheckpointError
from cona.runner.publish import UNIVERSAL_SUFFIX, universal_name, write_marker

ROW_PARALLEL_SUFFIXES = (".self_attention.dense.weight", ".mlp.dense_4h_to_h.weight")
ROW_PARALLEL_DIM = 1
STATE_FILES = ("fp32.pt", "exp_avg.pt", "exp_avg_sq.pt")
CONVERTER_LOG = "ds_to_universal.log"
SOURCE_FILE = "cona_source.json"
"""Written into a universal directory: the identity of the checkpoint it was converted from."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Publication:
    """What publishing one checkpoint did."""

    universal: Path
    convert_s: float
    repaired: tuple[str, ...]
    """Parameters whose concatenation dimension was rewritten (defect A)."""


def converter_command(env: MdsEnvironment, source: Path, output: Path) -> list[str]:
    """``python -m deepspeed.checkpoint.ds_to_universal`` with one worker per phase (the merge phase holds
    whole
    tensors in memory; CONA runs it on the node that drives the chain)."""
    return [
        str(env.python), "-m", "deepspeed.checkpoint.ds_to_universal",
        "--input_folder", str(source),
        "--output_folder", str(output),
        "--num_extract_workers", "1",
        "--num_merge_workers", "1",
    ]  # fmt: skip


def publish(
    env: MdsEnvironment, global_step_dir: Path, *, base_env: Mapping[str, str], repair: bool = True
) -> Publication:
    """Convert ``global_step_dir`` to universal (repairing defect A unless ``repair`` is off, which only the
    tests that show the defect do) and point ``latest_universal`` at it. Idempotent."""
    source = Path(global_step_dir)
    final = source.parent / universal_name(source)
    began = time.perf_counter()
    repaired: tuple[str, ...] = ()
    if final.is_dir() and _read_source(final) != source_identity(source):
        shutil.rmtree(final)  # converted from an earlier checkpoint of the same iteration (another run)
    if not final.is_dir():
        tmp = final.with_name(final.name + ".tmp")
        if tmp.exists():
            shutil.rmtree(tmp)  # left by a conversion that was killed halfway
        _convert(env, source, tmp, base_env)
        repaired = repair_row_parallel(tmp) if repair else ()
        write_json_atomic(tmp / SOURCE_FILE, source_identity(source))  # durable before the rename
        os.replace(tmp, final)
    write_marker(source.parent / LATEST_UNIVERSAL, final.name)
    return Publication(universal=final, convert_s=time.perf_counter() - began, repaired=repaired)


def source_identity(global_step_dir: Path) -> list[list]:
    """What tells this checkpoint from another of the same name: its files' names, sizes and modification
    times (a later save of the same iteration rewrites them)."""
    files = sorted(path for path in Path(global_step_dir).iterdir() if path.is_file())
    return [[path.name, path.stat().st_size, path.stat().st_mtime_ns] for path in files]


def _read_source(universal_dir: Path) -> list[list] | None:
    try:
        return json.loads((universal_dir / SOURCE_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _convert(env: MdsEnvironment, source: Path, output: Path, base_env: Mapping[str, str]) -> None:
    log = source.parent / CONVERTER_LOG
    with open(log, "w") as handle:
        returncode = subprocess.call(
            converter_command(env, source, output),
            stdout=handle,
            stderr=subprocess.STDOUT,
            env=env.process_env(base_env, device_type="cpu"),  # the converter is CPU-only
            cwd=env.repo,
        )
    if returncode != 0:
        tail = log.read_text().strip().splitlines()[-3:]
        raise CheckpointError(
            f"ds_to_universal failed on {source} (exit {returncode}; log {log}): {' / '.join(tail)}"
        )
    if not (output / "zero").is_dir():
        raise CheckpointError(f"ds_to_universal wrote no zero/ directory into {output} (log {log})")


def repair_row_parallel(universal_dir: Path) -> tuple[str, ...]:
    """Rewrite ``cat_dim`` to 1 for every row-parallel parameter of a universal checkpoint that says otherwise
    (defect A). Returns the parameters changed; a checkpoint saved at tp>1 needs none."""
    import torch  # here, not at import: the CLI's --help must not pay for torch

    changed = []
    for param_dir in sorted((Path(universal_dir) / "zero").iterdir()):
        if not (param_dir.is_dir() and param_dir.name.endswith(ROW_PARALLEL_SUFFIXES)):
            continue
        for name in STATE_FILES:
            path = param_dir / name
            if not path.is_file():
                continue
            state = _load_state_file(torch, path)
            if state.get("cat_dim", 0) != ROW_PARALLEL_DIM:
                state["cat_dim"] = ROW_PARALLEL_DIM
                torch.save(state, path)
                if param_dir.name not in changed:
                    changed.append(param_dir.name)
    return tuple(changed)


def _load_state_file(torch, path: Path) -> dict:
    """One of DeepSpeed's universal state files, weights-only (tensors and plain data): a file that names
    any other object is refused, and nothing in it runs."""
    import pickle

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        why = next((line for line in str(err).splitlines() if "Unsupported" in line), "not plain data")
        raise CheckpointError(f"{path}: refused, {why.strip()}; nothing in it was run") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: not a DeepSpeed universal state file (a {type(state).__name__})")
    return state


def check_reshardable(env: MdsEnvironment, tps: Sequence[int], *, where: str) -> None:
    """Refuse a run whose tensor-parallel degree changes on a checkout with the blocked fused-QKV layout (its
    universal checkpoints would mix Q, K and V; defect B)."""
    if len(set(tps)) > 1 and qkv_layout(env.repo) == "blocked":
        changes = " -> ".join(f"tp{tp}" for tp in tps)
        raise ChainError(
            f"{where}: the chain changes the tensor-parallel degree ({changes}), but the Megatron-DeepSpeed "
            f"checkout {env.repo} splits its fused QKV output in [Q; K; V] blocks per tp rank (commit "
            "676a482c and later), which ds_to_universal cannot reshard; keep tp fixed, or use a checkout "
            "before 676a482c"
        )


def is_universal(path: Path) -> bool:
    return Path(path).name.endswith(UNIVERSAL_SUFFIX)
