"""Which multiple of the measured noise scale makes the efficiency model agree with online runs' own progress.

Online mode values a token at global batch ``M`` at ``(k phi + M0) / (k phi + M)`` of one at the base batch
``M0`` (``training.noise_scale_factor`` is ``k``; ``phi`` the measured noise scale). Runs of one preset that
took different gbs paths and reached the same eval perplexity made the same progress, so the model should
credit them equally there. For each ``k`` this prints, per perplexity level, the spread (standard deviation
over mean) of the progress the model credits each run with where its eval perplexity crossed that level,
integrated along the run's own gbs path and its measured noise scale; the ``k`` with the smallest spread
fits best.
``raw tokens`` is the spread with every token counted alike (no efficiency at all).

Example (the twenty-third session's eight H100 runs, docs/benchmarks.md; each ``RUN`` is an online run's
logs folder, ``WORK/online/logs/online``)::

    PYTHONPATH=src .venv/bin/python bench/efficiency_calibration.py RUN [RUN ...] --base-gbs 8

A fixed run makes no decisions, so it has no measured noise scale of its own: ``--noise-from RUN ...``
gives it the median of those online runs' noise scales at its tokens (within ``NOISE_WINDOW`` either side),
a trajectory of the same preset; e.g. fixed runs at two gbs and the same LR, to see which ``k`` credits them
alike without online's switches (twenty-sixth session).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from pathlib import Path

import numpy as np

from cona.planner.efficiency import statistical_efficiency

FACTORS = (1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0)
LEVELS = (80.0, 60.0, 40.0, 30.0, 25.0, 22.0)
NOISE_WINDOW = 500_000
"""Tokens either side of a point whose pooled noise scales ``--noise-from`` takes the median of."""


def decision_noise(run: Path) -> np.ndarray:
    """(consumed tokens, measured noise scale) at each of the run's decisions (none: an empty array)."""
    path = run / "decisions.jsonl"
    decisions = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    noise = [(d["consumed_tokens"], d["noise_scale"]) for d in decisions if d.get("noise_scale")]
    return np.asarray(noise, dtype=float).reshape(-1, 2)


def pooled_noise(runs: list[Path]) -> np.ndarray:
    """(tokens, median noise scale within NOISE_WINDOW) over the decisions of ``runs``, on a 0.1M grid."""
    points = np.concatenate([decision_noise(run) for run in runs])
    if not points.size:
        raise SystemExit("--noise-from: no decision with a noise scale in those runs")
    rows = []
    for at in np.arange(0.0, points[:, 0].max() + 100_000, 100_000):
        near = points[np.abs(points[:, 0] - at) <= NOISE_WINDOW, 1]
        if near.size:
            rows.append((at, float(np.median(near))))
    return np.asarray(rows)


def read_run(run: Path, fallback: np.ndarray | None = None) -> tuple[list[dict], np.ndarray]:
    """The run's metrics lines, and (consumed tokens, noise scale) from its decisions, or ``fallback``
    (``--noise-from``) where it made none."""
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    noise = decision_noise(run)
    if not noise.size and fallback is not None:
        noise = fallback
    if not noise.size:
        raise SystemExit(f"{run}: no decision with a noise scale (a fixed run needs --noise-from)")
    return lines, noise


def crossings(
    run: Path, factor: float, base_gbs: int, fallback: np.ndarray | None = None
) -> dict[float, tuple[float, float]]:
    """Per level: (tokens, credited progress) where the eval perplexity crossed it, interpolated in log
    perplexity between the two evals around the crossing (an eval comes every ~0.2-0.3M tokens here, as
    much as the spreads this measures)."""
    lines, noise = read_run(run, fallback)
    tokens, progress, ppl = [0.0], [0.0], []
    for line in lines:
        at = float(line["consumed_tokens"])
        phi = float(np.interp((tokens[-1] + at) / 2, noise[:, 0], noise[:, 1])) * factor
        progress.append(
            progress[-1] + (at - tokens[-1]) * float(statistical_efficiency(line["gbs"], phi, base_gbs))
        )
        tokens.append(at)
        if line.get("eval_ppl") is not None:
            ppl.append((at, math.log(line["eval_ppl"])))
    found: dict[float, tuple[float, float]] = {}
    for (t0, p0), (t1, p1) in itertools.pairwise(ppl):
        for level in LEVELS:
            target = math.log(level)
            if level not in found and p1 <= target < p0:
                at = t0 + (t1 - t0) * (p0 - target) / (p0 - p1)
                found[level] = (at, float(np.interp(at, tokens, progress)))
    return found


def spread(values: list[float]) -> float:
    return float(np.std(values) / np.mean(values))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="runs' logs folders")
    parser.add_argument("--base-gbs", type=int, default=8)
    parser.add_argument("--noise-from", nargs="+", type=Path, default=[], help="online runs' logs folders")
    args = parser.parse_args(argv)
    fallback = pooled_noise(args.noise_from) if args.noise_from else None
    levels = [lv for lv in LEVELS if all(lv in crossings(r, 1.0, args.base_gbs, fallback) for r in args.runs)]
    header = " ".join(f"ppl {lv:g}".rjust(8) for lv in levels)
    print(f"{'k':>10} {header}     mean")
    for factor in FACTORS:
        at = [crossings(run, factor, args.base_gbs, fallback) for run in args.runs]
        row = [spread([c[lv][1] for c in at]) for lv in levels]
        print(f"{factor:>10g} {' '.join(f'{v:8.3f}' for v in row)} {np.mean(row):8.3f}")
    at = [crossings(run, 1.0, args.base_gbs, fallback) for run in args.runs]
    row = [spread([c[lv][0] for c in at]) for lv in levels]
    print(f"{'raw tokens':>10} {' '.join(f'{v:8.3f}' for v in row)} {np.mean(row):8.3f}")


if __name__ == "__main__":
    main()
