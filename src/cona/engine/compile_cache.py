"""Where compiled graphs persist between processes, so a model compiled before starts in seconds.

Inductor's FX graph cache (generated kernels) and AOTAutograd's cache (the joint forward/backward graphs)
live on disk under one directory per machine and user, shared by every run, resume, stage and helper
process there: a second run of the same model and shapes only retraces with dynamo and loads the rest.
``TORCHINDUCTOR_CACHE_DIR`` set by the user wins; otherwise it is ``$XDG_CACHE_HOME/cona/torch-compile``
(``~/.cache/cona/torch-compile``), which outlives ``/tmp`` cleaners and reboots, unlike torch's default.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch._dynamo.config
import torch._functorch.config
import torch._inductor.config

from cona.engine.step_modes import DYNAMO_RECOMPILE_LIMIT

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def compile_cache_dir() -> Path:
    """The directory of the persistent compile caches (see the module docstring)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "cona" / "torch-compile"


def use_persistent_compile_caches() -> Path:
    """Point inductor's and AOTAutograd's on-disk caches at :func:`compile_cache_dir`, switch both on and
    let dynamo keep a graph per shape a session runs; returns the directory. Idempotent; call it before the
    first compile of the process."""
    directory = compile_cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    os.environ[CACHE_ENV] = str(directory)  # read by inductor when it opens the cache, and by child processes
    torch._inductor.config.fx_graph_cache = True
    torch._functorch.config.enable_autograd_cache = True
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, DYNAMO_RECOMPILE_LIMIT)
    return directory
