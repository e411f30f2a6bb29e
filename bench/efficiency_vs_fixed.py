"""The policy's statistical efficiency against what fixed-gbs runs measured: tokens to one target.

Online mode values a token at global batch ``M`` at ``(phi + M0) / (phi + M)`` of one at the base batch
``M0`` (:func:`cona.planner.efficiency.statistical_efficiency`), with ``phi`` the noise scale it measures.
Fixed runs that reach the same target perplexity say how many tokens each gbs really needed. This prints:

* the progress (base-equivalent tokens) the model credits each fixed run with at the tokens it needed,
  integrating ``phi`` as an online run measured it along its tokens (its ``decisions.jsonl`` and
  ``metrics.jsonl``): equal progress for every gbs would mean the model is right;
* for each pair of batch sizes, the constant noise scale that the formula needs to give their measured
  token ratio (``(phi + M_b) / (phi + M_a) = T_b / T_a``), against the range the run measured.

Example (the numbers in docs/benchmarks.md, fourth session; the run directory is an online run's logs)::

    PYTHONPATH=src .venv/bin/python bench/efficiency_vs_fixed.py --run RUN/logs/online \\
        --fixed 8=14.68e6 16=14.16e6 32=16.78e6 32=18.35e6 64=30.15e6
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import numpy as np

from cona.planner.efficiency import statistical_efficiency


def noise_along_tokens(run: Path) -> tuple[np.ndarray, np.ndarray]:
    """(consumed tokens, measured noise scale) at each decision that had a noise scale."""
    tokens = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "iteration" in row:
            tokens[row["iteration"]] = row["consumed_tokens"]
    points = []
    for line in (run / "decisions.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get("noise_scale") and row.get("iteration") in tokens:
            points.append((tokens[row["iteration"]], row["noise_scale"]))
    if not points:
        raise SystemExit(f"{run}: no decision with a noise scale")
    return np.array([t for t, _ in points], dtype=float), np.array([p for _, p in points], dtype=float)


def credited_progress(tokens: float, gbs: int, base_gbs: int, noise: tuple[np.ndarray, np.ndarray]) -> float:
    """Base-equivalent tokens the model credits ``tokens`` trained at ``gbs``, along the measured phi."""
    grid = np.linspace(0.0, tokens, 4000)
    phi = np.interp(grid, *noise)  # before the first decision: the first measured value
    efficiency = np.array([statistical_efficiency(gbs, float(value), base_gbs) for value in phi])
    return float(np.sum(np.diff(grid, prepend=0.0) * efficiency))


def implied_noise_scale(small: tuple[int, float], large: tuple[int, float]) -> float:
    """The constant phi with ``(phi + M_b) / (phi + M_a) = T_b / T_a`` (inf: the larger batch needed no
    more tokens, i.e. perfect scaling between the two)."""
    (m_a, t_a), (m_b, t_b) = small, large
    ratio = t_b / t_a
    return float("inf") if ratio <= 1.0 else (m_b - ratio * m_a) / (ratio - 1.0)


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, required=True, help="an online run's logs folder")
    parser.add_argument("--fixed", nargs="+", required=True, help="GBS=TOKENS of fixed runs to one target")
    parser.add_argument("--base-gbs", type=int, default=8)
    args = parser.parse_args()
    noise = noise_along_tokens(args.run)
    low, high, tokens = noise[1].min(), noise[1].max(), noise[0][-1]
    print(f"measured noise scale: {low:.1f} to {high:.1f} over {tokens / 1e6:.2f}M tokens")
    fixed = sorted((int(g), float(t)) for g, t in (item.split("=") for item in args.fixed))
    for gbs, tokens in fixed:
        progress = credited_progress(tokens, gbs, args.base_gbs, noise)
        print(f"gbs {gbs:4d}: {tokens / 1e6:6.2f}M tokens, credited {progress / 1e6:6.2f}M base-equivalent")
    for small, large in itertools.combinations(fixed, 2):
        if small[0] < large[0]:
            phi = implied_noise_scale(small, large)
            print(f"gbs {small[0]} vs {large[0]} ({large[1] / small[1]:.3f}x tokens): implied phi {phi:.1f}")


if __name__ == "__main__":
    main()
