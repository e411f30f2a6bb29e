"""bench/decision_latency.py: each switch's delay after its line, the longest evaluation, late requests."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def latency_module(import_bench):
    return import_bench("decision_latency")


def test_switch_delays_and_late_requests_are_read_from_the_records(latency_module, tmp_path, capsys) -> None:
    records = [
        {"decision": "stay", "time": 10.0, "decided_at": 10.05, "evaluation_s": 0.04},
        {"decision": "switch", "time": 12.0, "decided_at": 12.5, "evaluation_s": 0.45},
        {"decision": "fallback", "time": 20.0, "decided_at": 23.0, "evaluation_s": 2.9},
        {"decision": "switch", "time": 30.0},  # before the timing fields: no delay to show
        {"decision": "not_carried_out", "time": 24.0, "decided_at": 24.0},
    ]
    found = latency_module.latency(records)
    assert found == {"switch_delays_s": [0.5, 3.0], "longest_evaluation_s": 2.9, "not_carried_out": 1}
    run_dir = tmp_path / "demo" / "20261202-000000" / "logs" / "online"
    run_dir.mkdir(parents=True)
    (run_dir / "decisions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    latency_module.main([str(tmp_path / "demo")])
    assert "switches 2, after their line [0.5, 3.0] s (latest 3.0)" in capsys.readouterr().out
