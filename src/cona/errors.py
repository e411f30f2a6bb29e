"""User-facing errors. Each message names the key, file, flag or step a person must fix.

The CLI prints these as one line (``cona: error: ...``) with no traceback and exits 2 for a
:class:`UsageError` (flags that do not go together, as argparse's own usage errors) and 1 for every other
(a config, data, checkpoint or launch failure). A file operation that fails on a path (an ``OSError`` that
names its file: a directory where a file should be, no permission, a full disk) is printed the same way,
``cona: error: PATH: reason``, exit 1 (``CONA_TRACEBACK=1`` shows its traceback too), and so is a symbolic
link loop met resolving a path; anything else that escapes is a bug and keeps its traceback.
"""

from pathlib import Path


def not_found(path: object, kind: str = "file") -> str:
    """Why ``path``, which should be a ``kind`` ("file" or "directory"), cannot be used as one: for a
    message naming it (``--system: {path} {not_found(path)}``)."""
    path = Path(str(path))
    if not path.exists():
        return "does not exist"
    if kind == "file":
        return "is a directory, not a file" if path.is_dir() else "is not a regular file"
    return "is a file, not a directory" if path.is_file() else "is not a directory"


class ConaError(ValueError):
    """Base class of every error caused by the user's input rather than by CONA itself."""


class UsageError(ConaError):
    """Command-line flags that are missing, out of range or do not go together (exit status 2)."""


class ConfigError(ConaError):
    """A bad ``.conaconfig`` key or value."""


class DataError(ConaError):
    """A bad or missing dataset, index or tokenizer file."""


class LayoutError(ConaError):
    """A parallel layout (dp, tp, pp, mbs, gbs) that cannot run this model."""


class CheckpointError(ConaError):
    """A missing, incomplete or incompatible checkpoint."""


class ChainError(ConaError):
    """A bad chain config (names the step and the key)."""


class PlanError(ConaError):
    """A bad planner input: unknown system, impossible strategy, missing model key."""


class LaunchError(ConaError):
    """A stage that could not be started or whose workers failed."""


class TrainingDiverged(ConaError):
    """The loss or the gradients left the finite or sensible range; training stopped instead of going on."""
