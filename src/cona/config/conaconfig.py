""".conaconfig: JSON with sections ``model`` and ``training`` -> frozen dataclasses.

Every key of the original CONA README's two tables (README.md, Configuration) is here, plus what the
engine needs. :func:`parse_config` reads a decoded file: unknown keys (with a "did you mean"), wrong types,
placeholders copied from that README's example (``"<num_layers>"``) and numbers given as strings are refused
there, impossible values by the sections themselves; each refusal is one line naming the file and the key.
Relative paths are relative to the file's directory.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cona.config.fields import expect_section, reject_unknown, typed_values
from cona.config.model import ModelConfig
from cona.config.training import DEFAULTS, SECTION_OF, SECTIONS, TrainingConfig
from cona.errors import ConfigError

CONFIG_NAME = ".conaconfig"
PATH_KEYS = (
    "data_prefix",
    "vocab_file",
    "merge_file",
    "data_cache_path",
    "log_root",
    "wandb_dir",
    "tensorboard_dir",
)
"""The ``training`` keys that name files or directories."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ConaConfig:
    """A whole ``.conaconfig`` after validation."""

    model: ModelConfig
    training: TrainingConfig
    path: Path | None = field(default=None, compare=False)
    """The file it came from (None when built in code)."""
    overrides: tuple[str, ...] = field(default=(), compare=False)
    """The ``--set SECTION.KEY=VALUE`` given over the file's keys (already in ``model`` and ``training``;
    kept to pass on to the runners of the other nodes)."""

    def to_dict(self) -> dict[str, Any]:
        """Both sections as the file writes them (``training`` flat)."""
        model = {f.name: getattr(self.model, f.name) for f in dataclasses.fields(self.model)}
        return {"model": model, "training": self.training.to_flat()}

    def identity_dict(self) -> dict[str, Any]:
        """:meth:`to_dict` without the keys at their defaults: what a run directory is made for. A key that a
        later CONA adds at its default then leaves a run started before it resumable after the upgrade."""
        model = {
            f.name: getattr(self.model, f.name)
            for f in dataclasses.fields(self.model)
            if f.default is dataclasses.MISSING or getattr(self.model, f.name) != f.default
        }
        return {"model": model, "training": self.training.explicit_flat()}


def parse_config(raw: Any, *, source: Path | None = None, where: str | None = None) -> ConaConfig:
    """Validate a decoded JSON object; ``source`` names the file in errors (``where`` instead, when given)
    and anchors relative paths."""
    where = where or (str(source) if source is not None else "<config>")
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: the top level must be an object with sections 'model' and 'training'")
    reject_unknown(raw, ("model", "training"), where, prefix="")
    if "model" not in raw:
        raise ConfigError(f"{where}: missing section 'model'")
    model_raw = expect_section(raw, "model", where)
    training_raw = expect_section(raw, "training", where) if "training" in raw else {}
    base_dir = source.parent if source is not None else Path.cwd()
    training_values = _training_values(training_raw, where)
    for key in PATH_KEYS:
        # Defaults (log_root "logs") are relative to the file too, not to wherever cona was started.
        value = training_values.get(key, DEFAULTS[key])
        if isinstance(value, str):
            training_values[key] = str((base_dir / Path(value).expanduser()).resolve())
    model_values = typed_values(ModelConfig, model_raw, where, "model")
    training = _built(where, TrainingConfig, **training_values)
    # A missing vocab file leaves vocab_size unknown here: commands that need it (training, the
    # planner) refuse through check_training_files / ModelConfig.padded_vocab_size, naming the key.
    vocab_file, tokenizer = training.data.vocab_file, training.data.tokenizer_type
    if model_values.get("vocab_size") is None and vocab_file is not None and Path(vocab_file).is_file():
        model_values["vocab_size"] = vocab_size_from_file(Path(vocab_file), where, tokenizer)
    model = _built(where, ModelConfig, **model_values)
    if model.family == "bert" and training.data.tokenizer_type != "BertWordPieceLowerCase":
        # The file names the tokenizer its data was made with; a config built in code may train on
        # synthetic tokens.
        raise ConfigError(
            f"{where}: training.tokenizer_type: model.family 'bert' needs 'BertWordPieceLowerCase' "
            "(masked-LM samples use [CLS]/[SEP]/[MASK])"
        )
    return ConaConfig(model=model, training=training, path=source)


def _built(where: str, cls: type, **values: Any) -> Any:
    """``cls(**values)``, its refusal prefixed with the file it came from."""
    try:
        return cls(**values)
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None


def _training_values(raw: dict, where: str) -> dict[str, Any]:
    """The typed flat keys of the file's ``training`` section, checked section by section."""
    reject_unknown(raw, SECTION_OF, where, prefix="training.")
    values: dict[str, Any] = {}
    for name, cls in SECTIONS.items():
        section_raw = {key: value for key, value in raw.items() if SECTION_OF[key] == name}
        values |= typed_values(cls, section_raw, where, "training")
    return values


def vocab_size_from_file(vocab_file: Path, where: str, tokenizer_type: str = "GPT2BPETokenizer") -> int:
    """Number of entries of a GPT-2 ``vocab.json`` (50257 for GPT-2) or lines of a WordPiece ``vocab.txt``."""
    try:
        if tokenizer_type == "BertWordPieceLowerCase":
            return len(vocab_file.read_text(encoding="utf-8").splitlines())
        return len(json.loads(vocab_file.read_text()))
    except FileNotFoundError:
        raise ConfigError(f"{where}: training.vocab_file: {vocab_file} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        kind = "UTF-8 WordPiece" if tokenizer_type == "BertWordPieceLowerCase" else "JSON"
        raise ConfigError(f"{where}: training.vocab_file: {vocab_file} is not a {kind} vocabulary") from None
