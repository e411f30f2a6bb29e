"""Where a Megatron-DeepSpeed checkout, its Python and the import shim are, and what the checkout's code does.

The backend never imports Megatron or DeepSpeed into CONA's own process: every launch and conversion runs in
the
checkout's interpreter (a separate venv with its own pins, see ``scripts/setup_megatron_deepspeed.sh``) with
``PYTHONPATH=<shim>:<checkout>``. Paths come from the CLI flags or, when a flag is absent, from the
environment
variables below (which the integration tests also read).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from cona.errors import ConfigError

REPO_ENV = "CONA_MEGATRON_DEEPSPEED"
PYTHON_ENV = "CONA_MEGATRON_DEEPSPEED_PYTHON"
SHIM_ENV = "CONA_MEGATRON_DEEPSPEED_SHIM"
ATTENTION_SOURCE = Path("megatron/model/transformer.py")
LAUNCHED_DIR = Path(__file__).resolve().parent / "launched"
"""Files that run inside the checkout's processes (its interpreter, not CONA's): CONA's hooks."""
ENTRY_SCRIPT = LAUNCHED_DIR / "cona_pretrain_gpt.py"
"""What the launcher runs: installs the hooks, then runs the checkout's pretrain_gpt.py unchanged."""
# Since commit 676a482c (FPDT) each tensor-parallel rank's fused QKV output is split as [Q; K; V] blocks
# (these
# slices of ``mixed_x_layer`` by ``projection_size`` or by a third of its width). DeepSpeed's universal
# checkpoint
# merges and splits the fused weight along dim 0 as if it were interleaved per head, which mixes Q, K and V
# as soon
# as the tensor-parallel degree changes. Before that commit the layout is per head and reshards correctly.
_BLOCKED_QKV = re.compile(
    r"mixed_x_layer\[:, :, :self\.projection_size\]|each_hidden_size = mixed_x_layer\.shape\[-1\] // 3"
)
QkvLayout = Literal["per-head", "blocked"]


@dataclass(frozen=True, kw_only=True, slots=True)
class MdsEnvironment:
    """A Megatron-DeepSpeed checkout and the interpreter that runs it."""

    repo: Path
    """The checkout (holds ``pretrain_gpt.py``); must be writable: rank 0 rebuilds its data helpers at
    start."""
    python: Path
    """The checkout's interpreter (a venv with deepspeed, transformers, ...)."""
    shim: Path | None = None
    """A folder put first on PYTHONPATH (the import-only torchvision stub); None when not needed."""

    @property
    def deepspeed_launcher(self) -> Path:
        """The ``deepspeed`` launcher script installed beside the interpreter."""
        return self.python.parent / "deepspeed"

    def process_env(self, base: Mapping[str, str], *, device_type: str) -> dict[str, str]:
        """The environment of a launch or conversion: the shim and the checkout first on PYTHONPATH (the
        converter unpickles Megatron's args), and DeepSpeed's CPU accelerator on CPU."""
        paths = [str(self.shim)] if self.shim is not None else []
        paths.append(str(self.repo))
        if base.get("PYTHONPATH"):
            paths.append(base["PYTHONPATH"])
        env = {**base, "PYTHONPATH": os.pathsep.join(paths), "PYTHONUNBUFFERED": "1"}
        if device_type == "cpu":
            env["DS_ACCELERATOR"] = "cpu"
        else:
            env.setdefault(
                "CUDA_DEVICE_MAX_CONNECTIONS", "1"
            )  # Megatron asserts it with sequence parallelism
        return env


def resolve_environment(
    repo: str | Path | None, python: str | Path | None, shim: str | Path | None, env: Mapping[str, str]
) -> MdsEnvironment:
    """The environment from the flags, falling back to ``CONA_MEGATRON_DEEPSPEED[_PYTHON|_SHIM]``; checked so
    a
    wrong path fails here, with the flag's name, rather than inside a launch."""
    repo_value = repo or env.get(REPO_ENV)
    if not repo_value:
        raise ConfigError(f"--repo-path (or {REPO_ENV}) must name a Megatron-DeepSpeed checkout")
    repo_path = Path(repo_value).expanduser().resolve()
    if not (repo_path / "pretrain_gpt.py").is_file():
        raise ConfigError(f"--repo-path {repo_path}: not a Megatron-DeepSpeed checkout (no pretrain_gpt.py)")
    python_value = python or env.get(PYTHON_ENV) or shutil.which("python3")
    if not python_value:
        raise ConfigError(f"--mds-python (or {PYTHON_ENV}) must name the checkout's Python interpreter")
    python_path = Path(python_value).expanduser().absolute()  # not resolved: a venv's python is a symlink
    if not os.access(python_path, os.X_OK):
        raise ConfigError(f"--mds-python {python_path}: not an executable interpreter")
    launcher = python_path.parent / "deepspeed"
    if not launcher.is_file():
        raise ConfigError(
            f"--mds-python {python_path}: no deepspeed launcher beside it ({launcher}); "
            "run scripts/setup_megatron_deepspeed.sh REPO_PATH"
        )
    shim_value = shim or env.get(SHIM_ENV)
    shim_path = Path(shim_value).expanduser().resolve() if shim_value else None
    if shim_path is not None and not shim_path.is_dir():
        raise ConfigError(f"--mds-shim {shim_path}: not a directory")
    return MdsEnvironment(repo=repo_path, python=python_path, shim=shim_path)


def qkv_layout(repo: Path) -> QkvLayout:
    """How the checkout's attention splits its fused QKV output (read from its source, see _BLOCKED_QKV)."""
    source = Path(repo) / ATTENTION_SOURCE
    try:
        text = source.read_text()
    except FileNotFoundError:
        raise ConfigError(
            f"--repo-path {repo}: {ATTENTION_SOURCE} is missing; not a Megatron-DeepSpeed checkout"
        ) from None
    return "blocked" if _BLOCKED_QKV.search(text) else "per-head"
