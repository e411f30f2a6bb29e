"""bench/probe_noise.py on the CPU: equal branches from one state give the same probe loss to the bit (the
noise floor is 0 on a deterministic device), and a candidate probe reports both branches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_the_noise_floor_of_equal_branches_is_zero_on_the_cpu(tmp_path, tiny_config_file) -> None:
    config = tiny_config_file(data="random")
    env = {**os.environ, "PYTHONPATH": str(BENCH.parent / "src"), "CUDA_VISIBLE_DEVICES": ""}
    args = ["--config", str(config), "--gbs", "4", "--candidate-gbs", "8", "--warm-tokens", "256"]
    args += ["--probe-tokens", "128", "--repeats", "2"]
    done = subprocess.run(
        [sys.executable, str(BENCH / "probe_noise.py"), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    probes, (summary,) = rows[:-1], [row["summary"] for row in rows[-1:]]
    assert [row["kind"] for row in probes] == ["equal", "candidate"] * 2
    for row in probes:
        assert row["samples"] == 8 and row["current"]["gbs"] == 4
        assert row["candidate"]["gbs"] == (4 if row["kind"] == "equal" else 8)
    assert summary["noise_floor_mean_nats"] == summary["noise_floor_max_nats"] == 0.0
    assert len(summary["candidate_difference_nats"]) == 2
