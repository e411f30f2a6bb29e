"""bench/rebatch_eager.py on the CPU (its smoke run): one line per shape in the order given, each with the
first ``--line`` steps timed one by one, the last of them the measured (two-piece) step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_each_shape_of_the_sequence_gets_its_steps_timed_in_order() -> None:
    env = {**os.environ, "PYTHONPATH": str(BENCH.parent / "src"), "CUDA_VISIBLE_DEVICES": ""}
    args = ["--size", "tiny", "--seq", "16", "--mbs", "2,4,2", "--line", "3", "--steady", "2"]
    done = subprocess.run(
        [sys.executable, "rebatch_eager.py", *args], cwd=BENCH, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [row["mbs"] for row in rows] == [2, 4, 2]
    for row in rows:
        assert [step["measured"] for step in row["steps"]] == [False, False, True]
        assert row["line_ms"] == round(sum(step["ms"] for step in row["steps"]), 1)
        assert row["steady_ms"] > 0 and row["allocator"] == "default"


def test_profile_gives_each_shape_s_first_two_steps_ops_by_their_own_host_time() -> None:
    env = {**os.environ, "PYTHONPATH": str(BENCH.parent / "src"), "CUDA_VISIBLE_DEVICES": ""}
    args = ["--size", "tiny", "--seq", "16", "--mbs", "2", "--line", "2", "--steady", "1", "--profile"]
    args += ["--attention", "flash"]  # on the CPU its fallback, the math kernel
    done = subprocess.run(
        [sys.executable, "rebatch_eager.py", *args], cwd=BENCH, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (row,) = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert row["attention"] == "flash"
    for key in ("profile_first", "profile_second"):
        ops = row[key]
        assert 0 < len(ops) <= 12 and any(op["op"] == "aten::mm" for op in ops)
        assert [op["self_cpu_ms"] for op in ops] == sorted((op["self_cpu_ms"] for op in ops), reverse=True)
