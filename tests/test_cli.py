"""The CLI lists every subcommand, each has --help, and nothing that is not built pretends to work."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cona.cli import COMMAND_MODULES, main


def test_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for name in COMMAND_MODULES:
        assert name in out


@pytest.mark.parametrize("name", COMMAND_MODULES)
def test_each_subcommand_has_help(name, capsys):
    with pytest.raises(SystemExit) as info:
        main([name, "--help"])
    assert info.value.code == 0
    assert "usage: cona " + name in capsys.readouterr().out


def test_console_script_entry_point_runs():
    done = subprocess.run([sys.executable, "-m", "cona", "--version"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.startswith("cona ")


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--iter", "2"],  # --iters
        ["strategies", "--gpus", "2", "--system", "cpu_gloo", "--gbs", "8", "--js"],  # --json
        ["ckpt", "inspect", "x", "--js"],  # --json, a parser two levels down
    ],
)
def test_an_abbreviated_flag_is_refused_not_read_as_the_whole_one(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    flag = next(arg for arg in reversed(argv) if arg.startswith("--") and arg not in ("--gpus",))
    assert f"unrecognized arguments: {' '.join(argv[argv.index(flag) :])}" in capsys.readouterr().err
