"""bench/efficiency_calibration.py: runs planted with a known factor of the noise scale are credited alike at
that factor, and apart at another."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def planted_run(folder: Path, gbs: int, *, noise_scale: float, factor: float) -> Path:
    """A run at one gbs whose eval perplexity falls with the progress the model credits at ``factor``."""
    folder.mkdir()
    efficiency = (factor * noise_scale + 8) / (factor * noise_scale + gbs)
    lines = [
        {"consumed_tokens": tokens, "gbs": gbs, "eval_ppl": 200.0 / (1.0 + tokens * efficiency / 1e4)}
        for tokens in range(100, 400_000, 100)
    ]
    decisions = [{"consumed_tokens": tokens, "noise_scale": noise_scale} for tokens in (100, 400_000)]
    for name, rows in (("metrics.jsonl", lines), ("decisions.jsonl", decisions)):
        (folder / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
    return folder


def test_the_planted_factor_credits_the_runs_alike(import_bench, tmp_path: Path) -> None:
    bench = import_bench("efficiency_calibration")
    runs = [planted_run(tmp_path / f"gbs{g}", g, noise_scale=5.0, factor=4.0) for g in (16, 32, 64)]

    def spreads(factor: float) -> list[float]:
        at = [bench.crossings(run, factor, 8) for run in runs]
        return [bench.spread([c[level][1] for c in at]) for level in bench.LEVELS]

    assert max(spreads(4.0)) < 0.005
    assert min(spreads(1.0)) > 0.05
    tokens = [bench.crossings(run, 4.0, 8)[40.0][0] for run in runs]
    assert np.all(np.diff(tokens) > 0)  # the larger batches needed more tokens to the same level
