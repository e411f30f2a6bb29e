"""Publishing killed at each of its steps: a reader never finds ``latest_universal`` naming a missing or
incomplete directory, and rerunning ``publish`` finishes the job."""

from __future__ import annotations

import os
import shutil

import pytest
from tests.helpers.chain_fakes import make_checkpoint
from tests.helpers.kill_points import KillAt, kill_points, module_proxy

from cona.engine.checkpoint.load import load_model_tensors
from cona.runner import publish as publish_module
from cona.runner.publish import LATEST_UNIVERSAL, publish, read_marker


def published_weight(layout) -> float | None:
    """The weight value the checkpoint ``latest_universal`` names holds (loaded and verified), or None."""
    name = read_marker(layout / LATEST_UNIVERSAL)
    if name is None:
        return None
    weights = load_model_tensors(layout / name)["weight"]  # raises on a missing or incomplete directory
    return float(weights.flatten()[0])


@pytest.mark.parametrize("before", [None, 4], ids=["first publish", "over an earlier publish"])
def test_a_publish_killed_at_any_step_leaves_a_loadable_marker_and_a_rerun_finishes(
    tmp_path, monkeypatch, before
):
    if before is not None:
        publish(make_checkpoint(tmp_path, before))
    checkpoint = make_checkpoint(tmp_path, 6)
    layout = checkpoint.parent

    def run(killer: KillAt) -> None:
        with monkeypatch.context() as patch:
            patch.setattr(publish_module, "os", module_proxy(os, killer, ("replace", "link")))
            patch.setattr(publish_module, "shutil", module_proxy(shutil, killer, ("rmtree", "copy2")))
            publish(checkpoint)

    killed = 0
    for k, killer in kill_points(run):
        killed += 1
        allowed = {None if before is None else float(before), 6.0}  # the previous publish or this one
        assert published_weight(layout) in allowed, f"killed before {killer.calls[-1]} (k={k})"
        publish(checkpoint)  # the rerun after the kill
        assert (
            published_weight(layout) == 6.0
            and read_marker(layout / LATEST_UNIVERSAL) == "global_step6_universal"
        )
        shutil.rmtree(layout / "global_step6_universal")
        if before is None:
            (layout / LATEST_UNIVERSAL).unlink()
        else:
            publish_module.write_marker(layout / LATEST_UNIVERSAL, f"global_step{before}_universal")
    assert killed >= 3  # every file link, the rename and the marker's rename
