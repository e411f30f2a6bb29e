"""bench/efficiency_calibration.py: runs planted with a known factor of the noise scale are credited alike at
that factor, and apart at another."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest


def planted_run(folder: Path, gbs: int, *, noise_scale: float, factor: float, eval_every: int = 1) -> Path:
    """A run at one gbs whose eval perplexity (on every ``eval_every``-th line) falls with the progress the
    model credits at ``factor``."""
    folder.mkdir()
    efficiency = (factor * noise_scale + 8) / (factor * noise_scale + gbs)
    lines = [{"consumed_tokens": tokens, "gbs": gbs} for tokens in range(100, 400_000, 100)]
    for line in lines[::eval_every]:
        line["eval_ppl"] = 200.0 / (1.0 + line["consumed_tokens"] * efficiency / 1e4)
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


def test_a_crossing_between_two_evals_is_interpolated(import_bench, tmp_path: Path) -> None:
    bench = import_bench("efficiency_calibration")
    run = planted_run(tmp_path / "sparse", 16, noise_scale=5.0, factor=4.0, eval_every=97)
    tokens, progress = bench.crossings(run, 4.0, 8)[40.0]
    assert progress == pytest.approx(4e4, rel=0.01)  # 200 / (1 + progress / 1e4) = 40
    assert tokens == pytest.approx(4e4 * (20 + 16) / (20 + 8), rel=0.01)


def test_a_fixed_run_takes_the_online_runs_median_noise_scale_with_noise_from(
    import_bench, tmp_path: Path, capsys
) -> None:
    bench = import_bench("efficiency_calibration")
    fixed = [planted_run(tmp_path / f"gbs{g}", g, noise_scale=5.0, factor=4.0) for g in (16, 32)]
    for run in fixed:
        (run / "decisions.jsonl").unlink()  # a fixed run decides nothing
    # Online runs measured 4, 5 and 50 (an outlier) along the way: the median, 5, is the planted one.
    online = []
    for index, value in enumerate((4.0, 5.0, 50.0)):
        folder = tmp_path / f"online{index}"
        folder.mkdir()
        rows = [{"consumed_tokens": t, "noise_scale": value} for t in range(0, 500_000, 50_000)]
        (folder / "decisions.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        online.append(folder)
    pooled = bench.pooled_noise(online)
    assert np.allclose(pooled[:, 1], 5.0) and pooled[0, 0] == 0.0
    at = [bench.crossings(run, 4.0, 8, pooled) for run in fixed]
    assert max(bench.spread([c[level][1] for c in at]) for level in bench.LEVELS) < 0.005
    with pytest.raises(SystemExit, match="--noise-from"):
        bench.crossings(fixed[0], 4.0, 8)
    bench.main([str(run) for run in fixed] + ["--noise-from", *map(str, online)])
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[1:]}
    assert float(rows["4"][-1]) < float(rows["1"][-1])  # the planted factor fits better than 1
