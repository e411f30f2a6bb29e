"""Finding and reading a ``.conaconfig`` file, and the checks of its data files before a run starts.

Apart from the package's other modules (the config's types and validation, which the data modules import)
so that reading a config with its data checks imports the data modules without an import cycle.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from cona.config.conaconfig import CONFIG_NAME, PATH_KEYS, ConaConfig, parse_config
from cona.config.fields import read_json_file
from cona.config.model import ModelConfig
from cona.config.overrides import FLAG as OVERRIDE_FLAG
from cona.config.overrides import apply_overrides
from cona.config.training import SECTION_OF
from cona.data.checks import check_dataset
from cona.errors import ConfigError


def find_config(start: Path | None = None) -> Path:
    """The ``.conaconfig`` in ``start`` (default: cwd) or its nearest parent."""
    here = (start or Path.cwd()).resolve()
    for directory in (here, *here.parents):
        candidate = directory / CONFIG_NAME
        if candidate.is_file():
            return candidate
    raise ConfigError(f"no {CONFIG_NAME} in {here} or any parent directory; pass --config PATH")


def load_config(
    path: Path | str | None = None, *, check_data_files: bool = False, overrides: Sequence[str] = ()
) -> ConaConfig:
    """Read, resolve and validate a config file (found from the cwd when ``path`` is None), with the
    ``--set`` ``overrides`` over its keys (:mod:`cona.config.overrides`)."""
    config_path = Path(path) if path is not None else find_config()
    if config_path.is_dir():
        inside = config_path / CONFIG_NAME
        hint = f"; did you mean {inside}?" if inside.is_file() else f" (with no {CONFIG_NAME} in it)"
        raise ConfigError(f"config file {config_path} is a directory, not a {CONFIG_NAME} file{hint}")
    if not config_path.is_file():
        raise ConfigError(f"config file {config_path} does not exist")
    known = {"model": _field_names(ModelConfig), "training": tuple(SECTION_OF)}
    raw = apply_overrides(read_json_file(config_path), overrides, known_keys=known, path_keys=PATH_KEYS)
    where = f"{config_path} with {' '.join(f'{OVERRIDE_FLAG} {o}' for o in overrides)}" if overrides else None
    config = parse_config(raw, source=config_path, where=where)
    if overrides:
        config = dataclasses.replace(config, overrides=tuple(overrides))
    if check_data_files:
        check_training_files(config)
    return config


def _field_names(section: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(section))


def check_training_files(config: ConaConfig) -> None:
    """Refuse a config whose dataset or tokenizer files are missing, or whose data does not fit it (a
    validation split without a sample, token ids >= model.vocab_size): what ``cona train`` checks before it
    starts a worker."""
    where = str(config.path) if config.path else "<config>"
    data = config.training.data
    if data.data_prefix is None:
        raise ConfigError(f"{where}: training.data_prefix is required to train")
    for suffix in (".bin", ".idx"):
        if not Path(data.data_prefix + suffix).is_file():
            raise ConfigError(f"{where}: training.data_prefix: {data.data_prefix}{suffix} does not exist")
    for key in ("vocab_file", "merge_file"):
        value = getattr(data, key)
        if value is not None and not Path(value).is_file():
            raise ConfigError(f"{where}: training.{key}: {value} does not exist")
    check_dataset(config)
