"""Saving killed at each of its steps: ``latest`` always names a complete, loadable checkpoint (the old one
or the new one), a re-save of the same iteration never loses the old copy, and the next save succeeds."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from tests.helpers.chain_fakes import write_fake_chain_config
from tests.helpers.kill_points import KillAt, kill_points, module_proxy

from cona.config.file import load_config
from cona.engine.checkpoint import save as checkpoint_module
from cona.engine.checkpoint.info import LATEST
from cona.engine.checkpoint.load import load_model_tensors
from cona.engine.checkpoint.paths import TMP_PREFIX
from cona.engine.checkpoint.save import save_checkpoint
from cona.strategy import Strategy

STEPS = (
    "dcp_save",
    "write_manifest",
    "_write_json_files",
    "_publish",
    "exchange_paths",
    "_write_marker",
    "_remove",
)


def save(layout: Path, config, iteration: int, value: float) -> Path:
    model = torch.nn.Linear(3, 2)
    torch.nn.init.constant_(model.weight, value)
    state = {"iteration": iteration, "consumed_samples": 8 * iteration, "consumed_tokens": 64 * iteration}
    return save_checkpoint(
        layout,
        iteration=iteration,
        model_parts=[model],
        optimizer=torch.optim.AdamW(model.parameters()),
        trainer_state=state,
        config=config,
        strategy=Strategy(dp=1, tp=1, pp=1, mbs=1, gbs=8),
    )


def weight_of(checkpoint: Path) -> float:
    return float(load_model_tensors(checkpoint)["weight"].flatten()[0])  # verifies every file first


def old_copies(layout: Path, name: str) -> list[float]:
    """The weights of the complete copies of ``name`` moved aside by a re-save (loadable by hand)."""
    return [weight_of(path) for path in layout.glob(f"{TMP_PREFIX}replaced-{name}-*") if path.is_dir()]


def exchange_works(directory: Path) -> bool:
    (directory / "a").mkdir()
    (directory / "b").mkdir()
    try:
        return checkpoint_module.exchange_paths(directory / "a", directory / "b")
    finally:
        shutil.rmtree(directory / "a")
        shutil.rmtree(directory / "b")


@pytest.mark.parametrize("exchange", [True, False], ids=["atomic exchange", "without one"])
@pytest.mark.parametrize("iteration", [5, 6], ids=["re-save of the same iteration", "a later iteration"])
def test_a_save_killed_at_any_step_keeps_a_loadable_latest_and_the_next_save_succeeds(
    tmp_path, monkeypatch, iteration, exchange
):
    config = load_config(write_fake_chain_config(tmp_path))
    layout = tmp_path / "layout"
    if exchange and not exchange_works(tmp_path):
        pytest.skip("this filesystem has no atomic exchange of directories (renameat2 RENAME_EXCHANGE)")
    if not exchange:
        monkeypatch.setattr(checkpoint_module, "exchange_paths", lambda first, second: False)

    def run(killer: KillAt) -> None:
        with monkeypatch.context() as patch:
            for name in STEPS:
                patch.setattr(checkpoint_module, name, killer.wrap(name, getattr(checkpoint_module, name)))
            patch.setattr(checkpoint_module, "os", module_proxy(os, killer, ("replace",)))
            patch.setattr(checkpoint_module, "shutil", module_proxy(shutil, killer, ("rmtree",)))
            save(layout, config, iteration, 7.0)

    killed, steps = 0, set()
    for k, killer in kill_points(run):
        killed += 1
        steps.update(killer.calls)
        where = f"killed before {killer.calls[-1]} (k={k})"
        latest = layout / (layout / LATEST).read_text().strip()
        if latest.is_dir():
            assert weight_of(latest) in {5.0, 7.0}, where
        else:  # only without an exchange, between a re-save's two renames: the old copy is complete beside it
            assert not exchange and iteration == 5 and old_copies(layout, latest.name) == [5.0], where
        assert weight_of(save(layout, config, iteration, 7.0)) == 7.0  # the next save after the kill
        shutil.rmtree(layout)
        save(layout, config, 5, 5.0)
    assert killed >= 4
    # a re-save goes through the exchange (or its fallback)
    assert ("exchange_paths" in steps) == (iteration == 5)
    assert not list(layout.glob(f"{TMP_PREFIX}*"))


@pytest.fixture(autouse=True)
def _first_checkpoint(tmp_path):
    config = load_config(write_fake_chain_config(tmp_path))
    save(tmp_path / "layout", config, 5, 5.0)
