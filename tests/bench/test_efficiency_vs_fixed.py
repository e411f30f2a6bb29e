"""bench/efficiency_vs_fixed.py: the implied noise scale and the credited progress on known inputs."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "efficiency_vs_fixed.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("efficiency_vs_fixed", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_implied_noise_scale_recovers_a_planted_one(bench) -> None:
    phi = 40.0
    tokens = {m: 1e6 * (phi + m) / (phi + 8) for m in (8, 16, 32)}  # what the formula needs at each gbs
    assert bench.implied_noise_scale((16, tokens[16]), (32, tokens[32])) == pytest.approx(phi)
    assert bench.implied_noise_scale((8, 1e6), (16, 0.99e6)) == math.inf  # fewer tokens: perfect scaling


def test_credited_progress_follows_the_measured_noise_scale(bench, tmp_path: Path) -> None:
    metrics = [{"iteration": i, "consumed_tokens": i * 1000} for i in (10, 20)]
    decisions = [{"iteration": 10, "noise_scale": 24.0}, {"iteration": 20, "noise_scale": 24.0}]
    for name, rows in (("metrics.jsonl", metrics), ("decisions.jsonl", decisions)):
        (tmp_path / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
    noise = bench.noise_along_tokens(tmp_path)
    assert np.array_equal(noise[0], [10_000, 20_000])
    assert bench.credited_progress(5e5, 8, 8, noise) == pytest.approx(5e5)  # the base batch: one for one
    assert bench.credited_progress(5e5, 40, 8, noise) == pytest.approx(5e5 * 32 / 64, rel=1e-3)
