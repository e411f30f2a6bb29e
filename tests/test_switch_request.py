"""The typed switch request: what the runner writes is what the workers and the runner read back."""

from __future__ import annotations

import json

import pytest

from cona.strategy import Strategy
from cona.switch_request import ProbeAsk, SwitchRequest

TARGET = Strategy(dp=1, tp=1, pp=1, mbs=4, gbs=8)
ASK = ProbeAsk(lr_factor=1.41, min_lr_factor=1.41, samples=256, tolerance=0.01)


def test_a_request_round_trips_through_its_file_and_keeps_the_flat_fields_other_readers_use(tmp_path):
    probe = SwitchRequest(action="probe", reason="why", in_place=True, strategy=TARGET, probe=ASK)
    path = probe.write(tmp_path / "switch_request.json")
    raw = json.loads(path.read_text())
    assert raw["in_place"] is True and raw["action"] == "probe" and raw["strategy"]["gbs"] == 8
    assert SwitchRequest.read(path) == probe
    stop = SwitchRequest(action="stop", reason="target reached")
    assert SwitchRequest.read(stop.write(path)) == stop


def test_a_request_that_is_not_one_reads_as_none_and_a_wrong_one_is_refused(tmp_path):
    path = tmp_path / "switch_request.json"
    assert SwitchRequest.read(path) is None  # missing
    path.write_text('{"action": "switch"')  # torn
    assert SwitchRequest.read(path) is None
    path.write_text(json.dumps({"action": "jump", "reason": "?"}))
    assert SwitchRequest.read(path) is None
    with pytest.raises(ValueError, match="a probe request"):
        SwitchRequest(action="probe", reason="no numbers", strategy=TARGET)
    with pytest.raises(ValueError, match="a switch request"):
        SwitchRequest(action="switch", reason="no target")
