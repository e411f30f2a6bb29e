"""bench/noise_lag.py: the tracker's lag behind a centred noise scale, on planted noise-free runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

SEQ, GBS, SMALL = 512, 32, 16


@pytest.fixture(scope="module")
def lag_module(import_bench):
    return import_bench("noise_lag")


def run(noise_scale_at, lines: int = 400, steps: int = 8) -> list[dict]:
    """Metrics lines of ``steps`` steps at gbs 32, whose two-batch inputs give ``|G|^2`` = 1 and
    ``tr(Sigma)`` = ``noise_scale_at(tokens)`` exactly; the LR warm-up is over from the second line."""
    records, samples = [], 0
    for number in range(lines):
        samples += steps * GBS
        trace = noise_scale_at(samples * SEQ)
        small, big = 1.0 + trace / SMALL, 1.0 + trace / GBS
        records.append({"iteration": (number + 1) * steps, "consumed_samples": samples,
                        "consumed_tokens": samples * SEQ, "lr": 1e-3 if number else 2e-3,
                        "gns_small_sqr": small, "gns_big_sqr": big,
                        "gns_small_batch": SMALL, "gns_big_batch": GBS})  # fmt: skip
    return records


def test_a_constant_noise_scale_is_tracked_without_lag(lag_module) -> None:
    ratios = lag_module.lag_ratios(run(lambda tokens: 40.0), base_gbs=8, half_window_tokens=0.25e6)
    assert len(ratios) > 300
    assert all(ratio == pytest.approx(1.0) for _, ratio in ratios)
    unmeasured = [{**record, "gns_small_sqr": None} for record in run(lambda tokens: 40.0, lines=5)]
    assert lag_module.lag_ratios(unmeasured, base_gbs=8, half_window_tokens=0.25e6) == []


def test_a_steady_growth_is_followed_and_a_jump_shows_as_lag(lag_module) -> None:
    # phi = 10 per million tokens: the window of 500 x 8 samples (2.05M tokens) is centred about 1M tokens
    # back, where a plain average would say 30 at 4M tokens; the tracker follows the trend to about 40 (to
    # its newest group's mean, about 0.15M tokens back).
    ratios = lag_module.lag_ratios(
        run(lambda tokens: 10.0 * tokens / 1e6), base_gbs=8, half_window_tokens=0.25e6
    )
    at_4m = [ratio for tokens, ratio in ratios if 3.9e6 < tokens < 4.1e6]
    assert at_4m and all(0.93 < ratio < 1.07 for ratio in at_4m)
    # A jump from 10 to 40 at 4M tokens is no trend: just after it the window still holds the old values.
    jump = lag_module.lag_ratios(
        run(lambda tokens: 10.0 if tokens < 4e6 else 40.0), base_gbs=8, half_window_tokens=0.25e6
    )
    after = [ratio for tokens, ratio in jump if 4.25e6 < tokens < 4.5e6]
    assert after and all(ratio > 1.5 for ratio in after)
    rows = {label: (count, quartiles) for label, count, quartiles in lag_module.by_range(jump, [2, 4, 6])}
    assert sum(count for count, _ in rows.values()) == len([r for r in jump if r[0] <= 6e6])
    # Before the jump no lag; after it the lag, and never an overshoot: the tracker stays between its plain
    # average and its newest group's mean.
    assert rows["0-2M"][1][1] == pytest.approx(1.0) and rows["4-6M"][1][2] > 1.5
    assert min(ratio for tokens, ratio in jump if tokens > 4e6) > 0.99


def test_the_script_prints_quartiles_per_range(lag_module, tmp_path: Path, capsys) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in run(lambda tokens: 40.0)))
    lag_module.main([str(path), "--edges", "1,2"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("1 runs")
    assert out[-1].split()[0] == "1-2M" and out[-1].split()[-2:] == ["1.00", "1.00"]
