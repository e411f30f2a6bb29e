"""bench/ttt_level_crossings.py: level crossings interpolated in log perplexity, on planted runs."""

from __future__ import annotations

import math

import pytest
from test_ttt_headroom import SEQ, lines, write_run


@pytest.fixture(scope="module")
def crossings_module(import_bench):
    return import_bench("ttt_level_crossings")


def test_a_crossing_lies_between_the_evaluations_around_the_level_in_log_perplexity(
    crossings_module, tmp_path, capsys
) -> None:
    # Fixed gbs 8: 1 s first step, 0.1 s steps, 4 a line (32 samples); evaluations at lines 2 and 4.
    write_run(tmp_path, "fixed-gbs8", lines([(8, 4, 0.1)], first_step_s=1.0, ppl_at={2: 200.0, 4: 50.0}))
    # Online: the same lines at gbs 8, evaluations at lines 1 and 4.
    write_run(tmp_path, "online", lines([(8, 4, 0.1)], first_step_s=1.0, ppl_at={1: 400.0, 4: 50.0}))
    runs = dict(crossings_module.measured_runs(tmp_path))
    # ppl 100 lies halfway between 200 and 50 in log perplexity: halfway between lines 2 and 4.
    tokens, seconds = crossings_module.crossing(runs["fixed-gbs8"], 100.0)
    assert tokens == pytest.approx(3 * 32 * SEQ) and seconds == pytest.approx(1.3 + 0.4 + 0.4)
    share = math.log(400 / 100) / math.log(400 / 50)  # online: from line 1 (400) to line 4 (50)
    tokens, seconds = crossings_module.crossing(runs["online"], 100.0)
    assert tokens == pytest.approx((1 + 3 * share) * 32 * SEQ) and seconds == pytest.approx(1.3 + 1.2 * share)
    assert crossings_module.crossing(runs["online"], 500.0) == (32 * SEQ, pytest.approx(1.3))  # first eval
    assert crossings_module.crossing(runs["online"], 10.0) is None
    (row,) = crossings_module.level_rows(runs, [100.0])
    assert row["interpolated"]["online_over_best"] == pytest.approx((1.3 + 1.2 * share) / 2.1)
    # As the report counts: both first at or below 100 at line 4.
    assert row["first_eval"]["online_over_best"] == pytest.approx(1.0)
    crossings_module.main(["--work-dir", str(tmp_path), "--target-ppl", "25"])
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:3] == ["ppl", "fixed-gbs8", "online"]
    rows = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert "interpolated" not in rows["27.5"]  # neither run reached it
    assert "interpolated 1.00" in rows["50"] and "first_eval 1.00" in rows["50"]  # both at line 4


def test_each_online_variant_gets_its_ratio_beside_online(crossings_module, tmp_path, capsys) -> None:
    write_run(tmp_path, "fixed-gbs8", lines([(8, 4, 0.1)], first_step_s=1.0, ppl_at={2: 200.0, 4: 50.0}))
    write_run(tmp_path, "online", lines([(8, 4, 0.1)], first_step_s=1.0, ppl_at={2: 200.0, 4: 50.0}))
    # The variant steps in 0.2 s: line 2 ends at 1.0 + 0.6 + 0.8 s against 1.0 + 0.3 + 0.4 s.
    write_run(tmp_path, "online-x", lines([(8, 4, 0.2)], first_step_s=1.0, ppl_at={2: 200.0, 4: 50.0}))
    runs = dict(crossings_module.measured_runs(tmp_path))
    (row,) = crossings_module.level_rows(runs, [200.0])
    ratios = row["first_eval"]["over_best"]
    assert ratios["online"] == pytest.approx(1.0) and ratios["online-x"] == pytest.approx(2.4 / 1.7)
    assert row["first_eval"]["online_over_best"] == pytest.approx(1.0)
    crossings_module.main(["--work-dir", str(tmp_path), "--target-ppl", "200"])
    assert "first_eval online 1.00, online-x 1.41" in capsys.readouterr().out
