"""The online summary's account of what each stage's predicted tokens/s rested on."""

from __future__ import annotations

import json

from cona.runner.state import RunState, StageState
from cona.runner.views.online_report import prediction_basis, stage_rows


def test_a_prediction_names_what_it_rested_on():
    assert prediction_basis({"throughput_source": "predicted", "fitted_on": 0}) == "prior"
    assert prediction_basis({"throughput_source": "predicted", "fitted_on": 3}) == "fit on 3"
    first_line = {"throughput_source": "predicted", "fitted_on": 0, "on_first_line": True}
    assert prediction_basis(first_line) == "first line"
    assert prediction_basis({"throughput_source": "measured", "fitted_on": 3}) == "measured"
    assert prediction_basis({"throughput_source": "probed", "fitted_on": 3}) == "probed"  # a won probe
    assert prediction_basis({"throughput_source": "predicted"}) == "prior"  # a record from before fitted_on
    fallback = {"throughput_source": "predicted", "fitted_on": 0, "action": "fallback"}
    assert prediction_basis(fallback) == "as before"  # back to a stage whose rate was never measured


def test_a_stage_s_rate_leaves_out_a_killed_attempt_s_lines_past_where_the_stage_ended(tmp_path):
    """Stage 1 ran to iteration 6 before a kill; rerun from its checkpoint at 4, it switched at 5. Lines 6
    (the killed attempt's, at another rate) are not stage 1's."""
    lines = [{"iteration": i, "stage": 1, "tokens_per_s": 100.0} for i in range(1, 6)]
    lines += [{"iteration": 6, "stage": 1, "tokens_per_s": 900.0}]
    lines += [{"iteration": i, "stage": 2, "tokens_per_s": 200.0} for i in range(6, 9)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    strategy = {"dp": 1, "tp": 1, "pp": 1, "mbs": 2, "gbs": 2}
    records = [{"strategy": strategy, "action": action} for action in ("initial", "switch")]
    stages = (
        StageState(step_num=1, status="done", start_iteration=0, last_iteration=5, consumed_tokens=5),
        StageState(step_num=2, status="done", start_iteration=5, last_iteration=8, consumed_tokens=8),
    )
    state = RunState(chain_path="", chain_digest="", config_digest="", world_size=1, stages=stages)
    rows = stage_rows(tmp_path, state, records)
    assert [row["tokens_per_s"] for row in rows] == [100.0, 200.0]
