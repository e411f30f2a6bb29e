"""bench/missing_fixed.py: a fixed run a call did not make, estimated from its host's rate at that batch."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_ttt_headroom import SEQ, lines, write_run


@pytest.fixture(scope="module")
def missing_module(import_bench):
    return import_bench("missing_fixed")


def test_the_estimate_scales_the_given_tokens_by_the_hosts_rate_and_the_measured_runs_overhead(
    missing_module, tmp_path: Path, capsys
) -> None:
    # Fixed gbs 8 at 0.1 s a step (640 tokens/s), a 2 s first step; its evaluation reaches ppl 20 at line 10
    # (320 samples, 2560 tokens) 2 + 39 x 0.1 = 5.9 s after its first step began: overhead 5.9 / (2 + 4).
    write_run(tmp_path, "fixed-gbs8", lines([(8, 12, 0.1)], first_step_s=2.0, ppl_at={10: 19.0}))
    # Online: gbs 4 at 0.05 s a step (640 tokens/s) for 3 lines, then gbs 8; ppl 20 at line 9.
    online = lines([(4, 3, 0.05), (8, 8, 0.1)], first_step_s=1.0, ppl_at={9: 19.5})
    write_run(tmp_path, "online", online)
    runs = [missing_module.run_numbers(n, r, 20.0) for n, r in missing_module.measured_runs(tmp_path)]
    fixed = next(run for run in runs if run.name == "fixed-gbs8")
    assert missing_module.overhead(fixed) == pytest.approx(5.9 / (2.0 + 2560 / 640))
    row = missing_module.call_row("call", runs, gbs=4, tokens=1280)
    # gbs 4's rate is the online run's steady lines' (the first line, with the first step, is not steady).
    assert row.rate == pytest.approx(4 * SEQ / 0.05)
    expected = missing_module.overhead(fixed) * (1.0 + 1280 / (4 * SEQ / 0.05))
    assert row.estimate == pytest.approx(expected)
    assert not row.measured
    online_s = next(run for run in runs if run.name == "online").time_to_target_s
    missing_module.main(["--gbs", "4", "--tokens", "1280", "--target-ppl", "20", str(tmp_path)])
    out = capsys.readouterr().out
    # Online over fixed gbs 8, then over the quicker estimate of fixed gbs 4.
    assert f"online {online_s / fixed.time_to_target_s:.2f} / {online_s / min(expected, 5.9):.2f}" in out
    ratios = (online_s / fixed.time_to_target_s, online_s / min(expected, 5.9))
    assert f"mean over 1 runs (online,online-again): {ratios[0]:.3f} / {ratios[1]:.3f}" in out


def test_a_call_that_ran_the_batch_fixed_gets_no_estimate(missing_module, tmp_path: Path) -> None:
    write_run(tmp_path, "fixed-gbs8", lines([(8, 12, 0.1)], first_step_s=2.0, ppl_at={10: 19.0}))
    write_run(tmp_path, "fixed-gbs4", lines([(4, 12, 0.05)], first_step_s=2.0, ppl_at={12: 25.0}))
    runs = [missing_module.run_numbers(n, r, 20.0) for n, r in missing_module.measured_runs(tmp_path)]
    row = missing_module.call_row("call", runs, gbs=4, tokens=1280)
    assert row.measured and row.estimate is None
    assert "measured" in missing_module.format_row(row)
