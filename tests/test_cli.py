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
