"""``cona demo``'s run directory: one of its own per demo, a clear error where none can be made."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from cona.commands.demo import new_run_root
from cona.data.demo import default_demo_runs
from cona.errors import ConaError

NOW = datetime(2026, 12, 5, 8, 45, 48, tzinfo=UTC)


def test_demos_started_in_the_same_second_get_directories_of_their_own(tmp_path):
    out = tmp_path / "runs" / "demo"  # made on the way
    roots = [new_run_root(out, NOW) for _ in range(3)]
    assert [root.name for root in roots] == ["20261205-084548", "20261205-084548-2", "20261205-084548-3"]
    assert all(root.is_dir() and not any(root.iterdir()) for root in roots)


def test_an_out_that_is_a_file_is_refused_naming_the_flag(tmp_path):
    out = tmp_path / "taken"
    out.write_text("not a directory")
    with pytest.raises(ConaError, match=r"cona demo --out: .*taken is not a directory"):
        new_run_root(out, NOW)


def test_an_out_that_cannot_be_made_is_refused_naming_the_flag(tmp_path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ConaError, match=r"cona demo --out: cannot create a run directory in .*a-file/demo: "):
        new_run_root(tmp_path / "a-file" / "demo", NOW)


def test_a_demo_writes_into_the_checkout_it_starts_from_else_into_the_user_data_directory(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    elsewhere = tmp_path / "home"
    elsewhere.mkdir()
    assert default_demo_runs(elsewhere) == tmp_path / "xdg" / "cona" / "runs" / "demo"  # not ./runs/demo
    checkout = tmp_path / "checkout"
    (checkout / "data" / "demo").mkdir(parents=True)
    assert default_demo_runs(checkout) == checkout / "runs" / "demo"
