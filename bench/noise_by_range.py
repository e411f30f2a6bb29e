"""The noise scale a run measured in each range of consumed samples, and what the tracker reported (issue 16).

Per range: the ratio of the mean ``tr(Sigma)`` to the mean ``|G|^2`` of the measurements taken there, by the
measurement's big batch (so runs at different gbs, or stages of one run, can be compared at the same samples);
then the tracker replayed over the whole run with each ``--fractions`` window fraction, its noise scale every
``--every`` iterations::

    PYTHONPATH=src .venv/bin/python bench/noise_by_range.py RUN/metrics.jsonl --edges 0,1500,3000,5000
"""

from __future__ import annotations

import argparse
import json

import numpy as np

import cona.planner.efficiency as efficiency


def read_records(path: str) -> list[dict]:
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def measurements(records: list[dict]) -> np.ndarray:
    """Rows of (consumed samples, big batch, |G|^2, tr(Sigma)), one per measured step."""
    rows = []
    for record in records:
        if record.get("gns_small_sqr") is None or "gns_small_batch" not in record:
            continue
        for small, big in record.get("gns_steps") or [[record["gns_small_sqr"], record["gns_big_sqr"]]]:
            grad, trace = efficiency.two_batch_estimate(
                small, big, record["gns_small_batch"], record["gns_big_batch"]
            )
            rows.append((record["consumed_samples"], record["gns_big_batch"], float(grad), float(trace)))
    return np.asarray(rows)


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("metrics")
    parser.add_argument("--edges", required=True, help="sample-range edges, comma-separated")
    parser.add_argument("--fractions", default="0.75,0.33", help="tracker window fractions")
    parser.add_argument("--base-gbs", type=int, default=8)
    parser.add_argument("--every", type=int, default=64)
    args = parser.parse_args()
    records = read_records(args.metrics)
    rows = measurements(records)
    edges = [int(x) for x in args.edges.split(",")]
    for low, high in zip(edges[:-1], edges[1:], strict=False):
        part = rows[(rows[:, 0] > low) & (rows[:, 0] <= high)]
        for big in sorted(set(part[:, 1])):
            chosen = part[part[:, 1] == big]
            ratio = chosen[:, 3].mean() / chosen[:, 2].mean()
            print(f"samples {low}-{high}, big batch {int(big)}, {len(chosen)} measurements: {ratio:.1f}")
    for fraction in (float(x) for x in args.fractions.split(",")):
        efficiency.WINDOW_FRACTION = fraction  # the module constant the tracker reads
        tracker, shown = efficiency.NoiseScaleTracker(base_batch=args.base_gbs), []
        for record in records:
            tracker = tracker.update_from_metrics(record)
            if (
                record.get("iteration")
                and record["iteration"] % args.every == 0
                and "consumed_samples" in record
            ):
                noise = tracker.noise_scale()
                shown.append(f"{record['consumed_samples']}:{'-' if noise is None else f'{noise:.0f}'}")
        print(f"tracker, window fraction {fraction:g}: " + " ".join(shown))


if __name__ == "__main__":
    main()
