"""A save removes only its own run's stale temporaries: another run's save in progress in the same layout
folder (two runs of one layout in one workdir) keeps its ``.tmp-global_step*`` directory."""

from __future__ import annotations

import json

import pytest

from cona.engine.checkpoint import save as ckpt
from cona.engine.checkpoint.paths import OWNER_TAG, tmp_owner
from cona.errors import CheckpointError


def test_a_save_removes_its_own_stale_temporaries_and_leaves_another_runs(tmp_path):
    mine, theirs = tmp_owner(tmp_path / "logs" / "a"), tmp_owner(tmp_path / "logs" / "b")
    assert mine != theirs and mine == tmp_owner(tmp_path / "logs" / "x" / ".." / "a")
    layout = tmp_path / "layout"
    own_stale = layout / f".tmp-global_step2-0000{OWNER_TAG}{mine}"
    in_progress = layout / f".tmp-global_step5-1111{OWNER_TAG}{theirs}"
    untagged = layout / ".tmp-global_step4-2222"
    for directory in (own_stale, in_progress, untagged):
        directory.mkdir(parents=True)
    (in_progress / "__0_0.distcp").write_bytes(b"shard")

    name = ckpt._agree_on_tmp_name(layout, 3, mine)

    assert name.startswith(".tmp-global_step3-") and name.endswith(f"{OWNER_TAG}{mine}")
    assert sorted(path.name for path in layout.iterdir()) == sorted([name, in_progress.name, untagged.name])
    assert (in_progress / "__0_0.distcp").read_bytes() == b"shard"
    ckpt._agree_on_tmp_name(layout, 6)  # a save without an owner cleans the untagged ones only
    assert in_progress.is_dir() and not untagged.exists()


def test_a_save_never_replaces_another_runs_checkpoint_of_the_same_iteration(tmp_path):
    """Two runs of one layout in one workdir: the second one's save of an iteration the first one saved is
    refused in one line, and the first one's checkpoint stays as it was; its own re-save goes ahead."""
    mine, theirs = tmp_owner(tmp_path / "logs" / "a"), tmp_owner(tmp_path / "logs" / "b")
    layout = tmp_path / "layout"
    (layout / "global_step4").mkdir(parents=True)
    (layout / "global_step4" / "trainer_state.json").write_text(json.dumps({"iteration": 4, "run": theirs}))
    with pytest.raises(CheckpointError, match=r"global_step4 is another run.s checkpoint .*--workdir"):
        ckpt._agree_on_tmp_name(layout, 4, mine)
    assert sorted(path.name for path in layout.iterdir()) == ["global_step4"]  # nothing made, nothing removed
    assert ckpt._agree_on_tmp_name(layout, 4, theirs).startswith(".tmp-global_step4-")  # its own: replaced
    assert ckpt._agree_on_tmp_name(layout, 4).startswith(".tmp-")  # a save without an owner, as before
