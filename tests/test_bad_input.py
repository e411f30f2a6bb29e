"""Bad input to the CLI: each case gets one line that names the file, key or flag, and a usage or run-time
exit status; never a traceback, a hang or exit 0."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
from tests.helpers.paths import RUN_CHAIN_SMALL
from tests.helpers.tiny import tiny_raw, write_tiny_config
from tests.helpers.tiny_runs import train_args

from cona.cli import main
from cona.config import parse_config
from cona.data.bert_vocab import jsonl_texts
from cona.data.indexed import IndexedDatasetWriter
from cona.errors import ChainError, ConfigError, DataError, LaunchError, PlanError, not_found
from cona.planner.systems import load_system
from cona.runner.nodes.multinode import parse_hostfile
from cona.runner.schedules.online_stages import StageRecords
from cona.runner.state import load_state

FIXTURE = RUN_CHAIN_SMALL
NOT_UTF8 = b"\xff\xfe{}\n"


def one_line_error(capsys, argv: list[str]) -> tuple[int, str]:
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return code, err


def test_a_failed_file_operation_is_one_line_naming_the_path(tmp_path, capsys):
    taken = tmp_path / "a-file"
    taken.write_text("")
    code, err = one_line_error(capsys, ["data", "demo", "--out", str(taken / "demo")])
    assert code == 1 and err.startswith(f"cona: error: {taken / 'demo'}: "), err


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "--initial-gbs", "0"],  # was an endless loop in the frontier
        ["plan", "--max-gbs", "-2"],
        ["plan", "--switch-cost-s", "nan"],
        ["plan", "--hysteresis", "inf"],
        ["plan", "--target-ppl", "nan"],
        ["train", "--target-ppl", "nan"],
        ["train", "--master-port-base", "0"],  # was refused only once stage 1 had started
        ["train", "--master-port-base", "70000"],
        ["train", "--num-nodes", "0"],  # was refused after the run directory was made
        ["train", "--dp", "0"],  # exited 1, as a layout refusal, where a flag out of range exits 2
        ["train", "--gbs", "-8"],
        ["train", "--iters", "0"],
        ["train", "--gpus-per-node", "-1"],
        ["strategies", "--seed", "-1"],
        ["strategies", "--seed", str(2**64)],
    ],
)
def test_numeric_flags_refuse_what_no_run_can_use(argv, capsys):
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    flag = next(word for word in argv[1:] if word.startswith("--"))
    assert f"argument {flag}: " in capsys.readouterr().err


def test_a_seed_out_of_range_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"training\.seed: must be from 0 to 2\*\*63 - 1, got -1"):
        parse_config(tiny_raw(training={"seed": -1}))


@pytest.mark.parametrize(
    "damage",
    [
        [],
        {"version": 1, "stages": "x"},
        {"version": 1, "stages": [5]},
        {"version": 1, "stages": [{}]},
        NOT_UTF8,
    ],
)
def test_a_damaged_run_state_is_refused_naming_the_file(tmp_path, damage):
    run_dir = tmp_path / "run"
    shutil.copytree(FIXTURE, run_dir)
    state = run_dir / "runner_state.json"
    state.write_bytes(damage if isinstance(damage, bytes) else json.dumps(damage).encode())
    with pytest.raises(ChainError, match=rf"{re.escape(str(state))}: .*rerun with --fresh to start over"):
        load_state(run_dir)


@pytest.mark.parametrize("damage", [b"[", b"{}", b"[5]", b'[{"strategy": {"dp": 1}}]', NOT_UTF8])
def test_damaged_online_stage_records_are_refused_naming_the_file(tmp_path, damage):
    records = StageRecords(tmp_path)
    records.path.write_bytes(damage)
    with pytest.raises(ChainError, match=rf"{re.escape(str(records.path))}: .*rerun with --fresh"):
        records.load(0)


def test_fewer_online_stage_records_than_stages_are_refused(tmp_path):
    records = StageRecords(tmp_path)
    records.path.write_text("[]")
    with pytest.raises(ChainError, match=r"0 stage records for 2 stages"):
        records.load(2)


def test_the_record_of_a_switch_killed_before_its_state_was_saved_is_dropped_on_resume(tmp_path):
    """The resumed run requests that switch again and records it anew: kept, the old record would stand
    where the new one belongs, and the stage after it would train the strategy before."""
    strategies = [{"dp": 1, "tp": 1, "pp": 1, "mbs": gbs, "gbs": gbs} for gbs in (1, 2, 4)]
    records = StageRecords(tmp_path)
    records.path.write_text(json.dumps([{"strategy": strategy} for strategy in strategies]))
    records.load(2)
    assert [records.strategy(step).gbs for step in (1, 2)] == [1, 2] and len(records.entries) == 2


def test_a_path_of_the_wrong_kind_is_named_as_such(tmp_path):
    assert not_found(tmp_path / "missing") == "does not exist"
    assert not_found(tmp_path) == "is a directory, not a file"
    assert not_found("/dev/null") == "is not a regular file"
    (tmp_path / "file").write_text("")
    assert not_found(tmp_path / "file", "directory") == "is a file, not a directory"


def test_a_failed_file_operation_keeps_its_traceback_when_asked(tmp_path, monkeypatch):
    taken = tmp_path / "a-file"
    taken.write_text("")
    monkeypatch.setenv("CONA_TRACEBACK", "1")
    with pytest.raises(OSError):
        main(["data", "demo", "--out", str(taken / "demo")])


def test_status_of_a_run_state_with_no_stages_answers(tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(FIXTURE, run_dir)
    state = json.loads((run_dir / "runner_state.json").read_text())
    (run_dir / "runner_state.json").write_text(json.dumps(state | {"stages": []}))
    assert main(["status", str(run_dir)]) == 0, capsys.readouterr().err


def test_a_run_directory_that_is_a_file_is_named_as_one(tmp_path, capsys):
    (tmp_path / "run").write_text("")
    code, err = one_line_error(capsys, ["report", str(tmp_path / "run")])
    assert code == 1 and "is a file, not a directory" in err


def test_a_dataset_prefix_whose_index_is_a_directory_is_refused_before_anything_is_written(tmp_path):
    (tmp_path / "data.idx").mkdir()
    (tmp_path / "data.bin").write_bytes(b"old")
    with pytest.raises(DataError, match=r"data\.idx is a directory"):
        IndexedDatasetWriter(tmp_path / "data", np.uint16)
    assert (tmp_path / "data.bin").read_bytes() == b"old"  # the old pair is left as it was
    assert sorted(path.name for path in tmp_path.iterdir()) == ["data.bin", "data.idx"]


def test_a_dataset_whose_publish_fails_leaves_no_temporary_file(tmp_path, monkeypatch):
    writer = IndexedDatasetWriter(tmp_path / "data", np.uint16)
    writer.add_document([1, 2, 3])

    def fail(*args):
        raise OSError(28, "No space left on device", str(args[1]))

    monkeypatch.setattr("cona.data.indexed.os.replace", fail)
    with pytest.raises(OSError, match="No space left"):
        writer.finalize()
    assert list(tmp_path.iterdir()) == []


def test_text_inputs_that_are_not_utf8_are_named(tmp_path):
    corpus, hostfile, system = tmp_path / "corpus.jsonl", tmp_path / "hosts", tmp_path / "system.json"
    for path in (corpus, hostfile, system):
        path.write_bytes(NOT_UTF8)
    with pytest.raises(DataError, match=rf"{re.escape(str(corpus))}, line 1: not valid UTF-8"):
        list(jsonl_texts(corpus, "text"))
    with pytest.raises(LaunchError, match=rf"--hostfile {re.escape(str(hostfile))}: not a text file"):
        parse_hostfile(hostfile)
    with pytest.raises(PlanError, match=rf"system {re.escape(str(system))}: not valid JSON"):
        load_system(str(system))
    with pytest.raises(
        PlanError, match=rf"--system: system file {re.escape(str(tmp_path))} is a directory, not a file"
    ):
        load_system(f"{tmp_path}/")


def test_a_system_whose_reserved_memory_leaves_nothing_is_refused_naming_the_key(tmp_path):
    shipped = resources.files("cona.planner").joinpath("systems", "h200_141g.json")
    system = json.loads(shipped.read_text())
    system["gpu"]["reserved_gib"] = system["gpu"]["memory_gib"] + 1
    path = tmp_path / "big_reserve.json"
    path.write_text(json.dumps(system))
    with pytest.raises(PlanError, match=r"gpu\.reserved_gib: leaves nothing of gpu\.memory_gib"):
        load_system(str(path))


def fixed_train(tmp_path: Path, workdir: Path, log_root: str) -> list[str]:
    config = write_tiny_config(tmp_path, data="random", training={"log_root": log_root})
    return train_args(config, workdir, "--run-name", "r", dp=1, iters=1)


@pytest.mark.parametrize("where", ["workdir", "log_root"])
def test_a_symbolic_link_loop_is_one_line_naming_the_path(tmp_path, capsys, where):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    looped = tmp_path / "a" / "inside"
    workdir, log_root = (looped, "logs") if where == "workdir" else (tmp_path / "work", str(looped))
    code, err = one_line_error(capsys, fixed_train(tmp_path, workdir, log_root))
    assert code == 1 and str(looped) in err and "symbolic link loop" in err, err


def test_a_full_log_root_is_one_line_naming_the_file(tmp_path, capsys, monkeypatch):
    """A write on a full disk raises an OSError that names no file; the file in log_root is then named."""
    import builtins
    import errno
    import os

    from cona import atomic_files

    class FullDisk:
        def __init__(self, handle) -> None:
            self.handle = handle

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            self.handle.close()

        def write(self, data) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def full_under_logs(file, mode="r", **kwargs):
        handle = builtins.open(file, mode, **kwargs)  # noqa: SIM115 (closed by atomic_open's with)
        return FullDisk(handle) if "logs" in str(file) and "w" in mode else handle

    argv = fixed_train(tmp_path, tmp_path / "work", "logs")
    monkeypatch.setattr(atomic_files, "open", full_under_logs, raising=False)
    code, err = one_line_error(capsys, argv)
    assert code == 1 and re.fullmatch(rf"cona: error: {tmp_path}/logs/r/\S+: No space left on device", err), (
        err
    )


@pytest.mark.parametrize(
    ("gbs", "iters", "refusal"),
    [
        (2**40, 1, r"--gbs 1099511627776: more than the \d+ samples of one epoch of the train split"),
        (8, 2**63 - 1, r"--gbs 8 x --iters 9223372036854775807 = \d+ samples: over 1000 epochs"),
    ],
)
def test_absurd_run_sizes_are_refused_before_anything_is_written(tmp_path, capsys, gbs, iters, refusal):
    argv = fixed_train(tmp_path, tmp_path / "work", "logs")
    argv[argv.index("--gbs") + 1], argv[argv.index("--iters") + 1] = str(gbs), str(iters)
    code, err = one_line_error(capsys, argv)
    assert code == 2 and re.search(rf"^cona: error: cona train {refusal}", err), err
    assert not (tmp_path / "logs").exists()


def test_a_gbs_that_scales_the_lr_past_1_is_warned_about(tmp_path, capsys):
    from cona.commands.train_runs import check_run_size
    from cona.config.file import load_config

    argv = fixed_train(tmp_path, tmp_path / "work", "logs")
    config = load_config(argv[argv.index("--config") + 1])
    check_run_size(config, 16, 4)
    assert capsys.readouterr().err == ""
    check_run_size(dataclasses.replace(config, training=config.training.replace(base_lr=0.5)), 64, 4)
    warning = capsys.readouterr().err
    assert warning.startswith(
        "cona: warning: --gbs 64 scales training.base_lr 0.5 by 2.828 (sqrt) to a peak LR"
    )
