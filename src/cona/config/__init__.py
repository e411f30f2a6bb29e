"""The ``.conaconfig``: its sections as frozen dataclasses, and how a file becomes them.

``from cona.config import ConaConfig, ModelConfig, TrainingConfig, parse_config`` is the public surface;
reading a file from disk with its data checks is :mod:`cona.config.file` (apart, because it imports the
data modules, which import this package).
"""

from cona.config.conaconfig import (
    CONFIG_NAME,
    DTYPES,
    PATH_KEYS,
    RECOMPUTE,
    ConaConfig,
    ModelConfig,
    TrainingConfig,
    parse_config,
    vocab_size_from_file,
)

__all__ = [
    "CONFIG_NAME",
    "DTYPES",
    "PATH_KEYS",
    "RECOMPUTE",
    "ConaConfig",
    "ModelConfig",
    "TrainingConfig",
    "parse_config",
    "vocab_size_from_file",
]
