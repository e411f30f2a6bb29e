"""The config-key tables of docs/configuration.md are the ones the dataclasses generate: every key,
documented, no drift."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from cona.config import ModelConfig, TrainingConfig
from cona.config.docs import END, START, config_keys_markdown, field_docs

PAGE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def test_every_config_key_has_a_docstring():
    for cls in (ModelConfig, TrainingConfig):
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
    for section, cls in (("model", ModelConfig), ("training", TrainingConfig)):
        for field in dataclasses.fields(cls):
            assert f"| `{section}.{field.name}` |" in block


def test_docstrings_are_read_from_the_source():
    docs = field_docs(TrainingConfig)
    assert docs["base_lr"] == "Peak learning rate at base_gbs."
    assert docs["wandb_project"].startswith("W&B project; W&B is off when omitted")
    assert "\n" not in docs["eval_every_tokens"]  # a multi-line docstring becomes one line
