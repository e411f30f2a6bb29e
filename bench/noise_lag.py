"""How far the noise-scale tracker lags the noise scale along recorded runs (issue 16).

The tracker (:class:`cona.planner.efficiency.NoiseScaleTracker`) averages the measurements of a window of past
samples, so where the noise scale grows it reports a value from about half a window ago. Here each run's
``metrics.jsonl`` is replayed through the tracker, and at every measured line its noise scale is set against a
*centred* one: the ratio of the mean ``tr(Sigma)`` to the mean ``|G|^2`` of the measurements within
``--half-window-tokens`` either side of the line (later measurements included, which a live run cannot
have). Printed per range of consumed tokens: the median and the quartiles of centred / tracker over all runs'
lines. Above 1 the tracker reports too small a noise scale, and so values larger batches too little::

    PYTHONPATH=src .venv/bin/python bench/noise_lag.py RUN/logs/RUN/metrics.jsonl ... --edges 0.5,1,2,4,8,16
"""

from __future__ import annotations

import argparse

import numpy as np

from cona.planner.efficiency import NoiseScaleTracker
from noise_by_range import measurements, read_records


def lag_ratios(records: list[dict], *, base_gbs: int, half_window_tokens: float) -> list[tuple[float, float]]:
    """(consumed tokens, centred / tracker noise scale) at every measured line where both are known."""
    counted = [r for r in records if r.get("consumed_samples") and r.get("consumed_tokens")]
    found = measurements(records)
    if not counted or not len(found):
        return []
    seq = counted[0]["consumed_tokens"] / counted[0]["consumed_samples"]
    rows = found[:, [0, 2, 3]] * [seq, 1.0, 1.0]  # (tokens, |G|^2, tr(Sigma))
    tracker = NoiseScaleTracker(base_batch=base_gbs)
    ratios = []
    for record in records:
        tracker = tracker.update_from_metrics(record)
        if record.get("gns_small_sqr") is None:
            continue
        tracked = tracker.noise_scale()
        position = record["consumed_tokens"]
        near = rows[np.abs(rows[:, 0] - position) <= half_window_tokens]
        if tracked is None or not tracked > 0 or len(near) < 3 or not near[:, 1].mean() > 0:
            continue
        ratios.append((position, max(near[:, 2].mean(), 0.0) / near[:, 1].mean() / tracked))
    return ratios


def by_range(ratios: list[tuple[float, float]], edges_m: list[float]) -> list[tuple[str, int, tuple]]:
    """(label, lines, (quartile 1, median, quartile 3)) per range of consumed tokens (edges in millions)."""
    edges = [0.0, *sorted(edges_m)]
    out = []
    for low, high in zip(edges, edges[1:], strict=False):
        values = [r for tokens, r in ratios if low * 1e6 < tokens <= high * 1e6]
        quartiles = tuple(np.percentile(values, [25, 50, 75])) if values else (np.nan,) * 3
        out.append((f"{low:g}-{high:g}M", len(values), quartiles))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("metrics", nargs="+", help="metrics.jsonl files of online or fixed runs")
    parser.add_argument("--base-gbs", type=int, default=8, help="training.base_gbs of the runs")
    parser.add_argument("--half-window-tokens", type=float, default=0.25e6)
    parser.add_argument("--edges", default="0.5,1,2,3,4,6,8,12,16", help="range edges, M tokens")
    args = parser.parse_args(argv)
    ratios = [
        ratio
        for path in args.metrics
        for ratio in lag_ratios(
            read_records(path), base_gbs=args.base_gbs, half_window_tokens=args.half_window_tokens
        )
    ]
    print(f"{len(args.metrics)} runs; centred / tracker noise scale by consumed tokens")
    print(f"{'tokens':>10} {'lines':>6} {'q1':>6} {'median':>7} {'q3':>6}")
    for label, count, (q1, median, q3) in by_range(ratios, [float(e) for e in args.edges.split(",")]):
        print(f"{label:>10} {count:>6} {q1:>6.2f} {median:>7.2f} {q3:>6.2f}")


if __name__ == "__main__":
    main()
