"""bench/ttt_start_floor.py: the floor an online run starting at G0 has at each level, on planted runs."""

from __future__ import annotations

import pytest
from test_ttt_headroom import SEQ, lines, write_run


@pytest.fixture(scope="module")
def floor_module(import_bench):
    return import_bench("ttt_start_floor")


def test_the_floor_is_online_s_second_line_plus_the_best_run_s_time_from_those_tokens(
    floor_module, tmp_path, capsys
) -> None:
    # Fixed gbs 8: 1 s first step, 0.1 s a step (4 steps a line); ppl 100 at line 6, ppl 40 at line 12.
    write_run(tmp_path, "fixed-gbs8", lines([(8, 12, 0.1)], first_step_s=1.0, ppl_at={6: 99.0, 12: 39.0}))
    # Fixed gbs 16: as fast a step, twice the tokens; ppl 100 at line 4 (sooner), ppl 40 never.
    write_run(tmp_path, "fixed-gbs16", lines([(16, 8, 0.1)], first_step_s=1.0, ppl_at={4: 99.0}))
    # Online: two lines at gbs 6 (48 samples, slow steps), then gbs 16; ppl 100 at its 6th line.
    online = lines([(6, 2, 0.2), (16, 6, 0.1)], first_step_s=1.0, ppl_at={6: 98.0})
    write_run(tmp_path, "online", online)
    floor_module.main(["--work-dir", str(tmp_path), "--target-ppl", "20"])
    out = capsys.readouterr().out
    decided_s = 1.0 + 3 * 0.2 + 4 * 0.2  # its second line, from its first step
    assert f"online's second line: {decided_s:.2f} s" in out and f"{48 * SEQ:,} tokens" in out
    runs = {name: records for name, records in floor_module.measured_runs(tmp_path)}
    rows = {row["level"]: row for row in floor_module.floors(runs, [100.0, 40.0, 20.0])}
    assert sorted(rows) == [40.0, 100.0]  # no fixed run reached ppl 20: no row
    at_100 = rows[100.0]
    assert at_100["best_fixed"] == "fixed-gbs16"
    best_s = 1.0 + 15 * 0.1  # 4 lines of gbs 16
    # Fixed gbs 16's first line (64 samples, 1.3 s) stands for any tokens up to its own: online's 48.
    assert at_100["best_s"] == pytest.approx(best_s)
    assert at_100["floor_s"] == pytest.approx(decided_s + best_s - 1.3)
    assert at_100["floor_over_best"] == pytest.approx((decided_s + best_s - 1.3) / best_s)
    online_s = 1.0 + 7 * 0.2 + 16 * 0.1
    assert at_100["online_over_best"] == pytest.approx(online_s / best_s)
    at_40 = rows[40.0]
    assert at_40["best_fixed"] == "fixed-gbs8" and at_40["online_over_best"] is None
    # Fixed gbs 8 had 32 samples at 1.3 s and 64 at 1.7 s: 48 at 1.5 s, between its lines.
    assert at_40["floor_s"] == pytest.approx(decided_s + (1.0 + 47 * 0.1) - 1.5)
