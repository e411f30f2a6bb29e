"""Finding a checkpoint and reading its JSON files, without a process group or a tensor.

A path names a checkpoint directly (a ``global_step<N>`` directory, or any directory with DCP ``.metadata``),
through the ``latest``/``latest_universal`` marker of a layout directory, or as the marker file itself.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cona.config import ConaConfig, ModelConfig, parse_config
from cona.engine.checkpoint.files import CONFIG_FILE, METADATA_FILE, TRAINER_STATE_FILE
from cona.engine.checkpoint.manifest import MANIFEST_FILE
from cona.errors import CheckpointError, ConaError
from cona.strategy import Strategy

LATEST = "latest"
LATEST_UNIVERSAL = "latest_universal"
STRATEGY_FILE = "strategy.json"
PROBE_FILE = "probe.json"
STEP_DIR = re.compile(r"global_step(\d+)(_universal)?")
# Model keys that decide which tensors a checkpoint holds and their shapes (ffn_hidden as resolved).
MODEL_SHAPE_KEYS = (
    "layers",
    "hidden",
    "heads",
    "seq",
    "ffn_hidden",
    "vocab_size",
    "padded_vocab_size",
    "normalization",
    "family",
    "kv_heads",
    "activation",
    "position_embedding",
    "tie_embeddings",
    "bias",
)


def model_shape(model: ModelConfig) -> dict[str, Any]:
    """The model keys that decide the set and shapes of the saved tensors (ffn_hidden resolved)."""
    return {key: getattr(model, "ffn_size" if key == "ffn_hidden" else key) for key in MODEL_SHAPE_KEYS}


def resolve_checkpoint(path: Path) -> Path:
    """The checkpoint directory ``path`` names: itself, or what its ``latest``/``latest_universal``
    marker (or the marker file ``path`` itself) points at."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if path.is_file():
        return _follow_marker(path)
    if (path / METADATA_FILE).exists() or STEP_DIR.fullmatch(path.name):
        return path
    for marker in (LATEST, LATEST_UNIVERSAL):
        if (path / marker).is_file():
            return _follow_marker(path / marker)
    raise CheckpointError(
        f"{path}: no checkpoint here: no '{LATEST}' or '{LATEST_UNIVERSAL}' marker and no "
        f"DCP {METADATA_FILE} file"
    )


def _follow_marker(marker: Path) -> Path:
    try:
        name = marker.read_text(encoding="utf-8").strip()
    except UnicodeDecodeError:
        raise CheckpointError(
            f"{marker}: not a checkpoint: expected a checkpoint directory or a marker file naming one"
        ) from None
    if not name or "/" in name or name.startswith("."):
        raise CheckpointError(
            f"{marker}: not a checkpoint marker (expected a global_step<N> directory name, got {name!r})"
        )
    target = marker.parent / name
    if not target.is_dir():
        raise CheckpointError(f"{marker} names {name}, which does not exist in {marker.parent}")
    return target


@dataclass(frozen=True, kw_only=True)
class CheckpointInfo:
    """The JSON files of a checkpoint directory (no tensors)."""

    path: Path
    trainer_state: dict
    config: ConaConfig
    strategy: Strategy | None
    manifest: dict | None
    probe: dict | None = None
    """The probe loss measured before the save (``probe.json``), if the saver recorded one."""


def read_checkpoint_info(path: Path) -> CheckpointInfo:
    """Read a checkpoint's JSON files; needs no process group (call it on one rank). Their checksums are
    not verified here (:func:`cona.engine.checkpoint.load.verify_checkpoint` does)."""
    checkpoint = resolve_checkpoint(path)
    trainer_state = _read_json(checkpoint, TRAINER_STATE_FILE)
    raw_config = _read_json(checkpoint, CONFIG_FILE)
    try:
        config = parse_config(raw_config, source=checkpoint / CONFIG_FILE)
    except ConaError as err:
        raise CheckpointError(f"{checkpoint}: unusable {CONFIG_FILE}: {err}") from None
    strategy = _read_json(checkpoint, STRATEGY_FILE, optional=True)
    manifest = _read_json(checkpoint, MANIFEST_FILE, optional=True)
    probe = _read_json(checkpoint, PROBE_FILE, optional=True)
    return CheckpointInfo(
        path=checkpoint,
        trainer_state=trainer_state,
        config=config,
        strategy=_strategy(checkpoint, strategy),
        manifest=manifest,
        probe=probe,
    )


def _strategy(checkpoint: Path, raw: dict | None) -> Strategy | None:
    if raw is None:
        return None
    try:
        return Strategy(**raw)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{checkpoint / STRATEGY_FILE}: not a strategy ({err})") from None


def _read_json(directory: Path, name: str, *, optional: bool = False) -> dict | None:
    file = directory / name
    if optional and not file.is_file():
        return None
    if not file.is_file():
        raise CheckpointError(f"{directory}: incomplete checkpoint: {name} is missing")
    try:
        document = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"{file}: not valid JSON") from None
    if not isinstance(document, dict):
        raise CheckpointError(f"{file}: expected a JSON object")
    return document
