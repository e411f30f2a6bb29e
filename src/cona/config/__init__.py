"""The ``.conaconfig``: its sections as frozen dataclasses that check their own values, and how a file
becomes them.

``from cona.config import ConaConfig, ModelConfig, TrainingConfig, parse_config`` is the public surface;
:mod:`cona.config.model` and :mod:`cona.config.training` hold the sections, :mod:`cona.config.conaconfig`
the whole file and its parsing, :mod:`cona.config.overrides` the ``--set`` flag and
:mod:`cona.config.docs` the generated key tables. Reading a file from disk with its data checks is
:mod:`cona.config.file` (not imported here: it imports the data modules, which import this package).
"""

from cona.config.conaconfig import CONFIG_NAME, PATH_KEYS, ConaConfig, parse_config, vocab_size_from_file
from cona.config.model import ModelConfig
from cona.config.training import (
    DTYPES,
    RECOMPUTE,
    CheckpointConfig,
    DataConfig,
    LoggingConfig,
    LRConfig,
    OnlineConfig,
    OptimizerConfig,
    RuntimeConfig,
    TrainingConfig,
)

__all__ = [
    "CONFIG_NAME",
    "DTYPES",
    "PATH_KEYS",
    "RECOMPUTE",
    "CheckpointConfig",
    "ConaConfig",
    "DataConfig",
    "LRConfig",
    "LoggingConfig",
    "ModelConfig",
    "OnlineConfig",
    "OptimizerConfig",
    "RuntimeConfig",
    "TrainingConfig",
    "parse_config",
    "vocab_size_from_file",
]
