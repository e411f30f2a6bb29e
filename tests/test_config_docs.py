"""The config-key tables of docs/configuration.md are the ones the dataclasses generate: every key,
documented, no drift."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from cona.config import LoggingConfig, LRConfig, ModelConfig, TrainingConfig
from cona.config.docs import END, START, config_keys_markdown, field_docs
from cona.config.training import SECTION_OF, SECTIONS

PAGE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def test_every_config_key_has_a_docstring():
    for cls in (ModelConfig, TrainingConfig, *SECTIONS.values()):
        docs = field_docs(cls)
        undocumented = [field.name for field in dataclasses.fields(cls) if not docs.get(field.name)]
        assert not undocumented, f"{cls.__name__}: give these fields a docstring: {undocumented}"


def test_the_configuration_page_lists_every_key_as_generated():
    text = PAGE.read_text()
    block = text[text.index(START) : text.index(END) + len(END)]
    assert block == config_keys_markdown(), (
        "docs/configuration.md's config-key tables are stale: "
        "PYTHONPATH=src python -m cona.config.docs --write docs/configuration.md"
    )
    for field in dataclasses.fields(ModelConfig):
        assert f"| `model.{field.name}` |" in block
    for key in SECTION_OF:
        assert f"| `training.{key}` |" in block


def test_docstrings_are_read_from_the_source():
    assert field_docs(LRConfig)["base_lr"] == "Peak learning rate at base_gbs."
    docs = field_docs(LoggingConfig)
    assert docs["wandb_project"].startswith("W&B project; W&B is off when omitted")
    assert "\n" not in docs["eval_every_tokens"]  # a multi-line docstring becomes one line
