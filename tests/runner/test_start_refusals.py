"""What ``cona train`` refuses at the start, before any worker trains, in one line: a ``--workdir`` that is
a file (fixed, chain and online modes), a ``--chain`` that names a directory, a bad ``--target-ppl``, and a
log_root where the run's ``latest`` pointer cannot be written (a full disk)."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
from tests.helpers.tiny_runs import train_args

from cona.cli import main
from cona.errors import LaunchError
from cona.runner import run_dir as run_dir_module

ONLINE = ["--gpus", "1", "--system", "a100_80g", "--initial-gbs", "1", "--max-gbs", "8", "--device", "cpu"]


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("cona: error: ") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("mode", ["fixed", "chain", "online", "inside-a-file"])
def test_a_workdir_that_is_a_file_is_refused_before_training(
    tmp_path: Path, capsys, mode, tiny_config_file
) -> None:
    config = tiny_config_file(data="random")
    blocker = tmp_path / "work"
    blocker.write_text("")
    workdir = blocker / "sub" if mode == "inside-a-file" else blocker
    chain = tmp_path / "chain.json"
    chain.write_text('{"steps": [{"dp": 1, "tp": 1, "pp": 1, "mbs": 2, "gbs": 2, "train_iters": 1}]}')
    argv = {
        "fixed": train_args(config, workdir, dp=1, gbs=2),
        "inside-a-file": train_args(config, workdir, dp=1, gbs=2),
        "chain": ["train", "--config", str(config), "--chain", str(chain), "--gpus", "1"],
        "online": ["train", "--config", str(config), *ONLINE, "--total-iters", "2"],
    }[mode]
    if mode in ("chain", "online"):
        argv += ["--workdir", str(workdir)]
    assert main(argv) == 1
    err = one_line_error(capsys)
    assert f"--workdir {workdir}" in err and ("is a file" in err or f"inside {blocker}" in err)
    assert not (tmp_path / "logs").exists()  # no run directory: nothing started


def test_a_chain_that_names_a_directory_is_one_line(tmp_path: Path, capsys, tiny_config_file) -> None:
    config = tiny_config_file(data="random")
    argv = ["train", "--config", str(config), "--chain", str(tmp_path), "--gpus", "1"]
    assert main([*argv, "--workdir", str(tmp_path / "work"), "--device", "cpu"]) == 1
    assert f"--chain {tmp_path} is a directory" in one_line_error(capsys)


@pytest.mark.parametrize("value", ["-5", "0", "0.5"])
def test_a_bad_target_ppl_names_that_flag(tmp_path: Path, capsys, value, tiny_config_file) -> None:
    config = tiny_config_file(data="random")
    assert main(["train", "--config", str(config), *ONLINE, "--target-ppl", value]) == 2
    err = one_line_error(capsys)
    assert "--target-ppl" in err and "lr_decay_tokens" not in err


def test_a_full_disk_under_log_root_is_one_line(tmp_path: Path, monkeypatch) -> None:
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "symlink_to", full)
    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(LaunchError) as caught:
        run_dir_module.create_run_dir(tmp_path / "logs", "run")
    assert str(caught.value) == f"cannot write {tmp_path / 'logs' / 'latest'}: No space left on device"
    assert caught.value.__context__ is None or caught.value.__suppress_context__
