"""A paired probe restores its state exactly under the parallel layouts (2 gloo processes, the tiny GPT):
equal branches give bit-identical losses, and the run goes on as one without the probe, to the bit."""

from __future__ import annotations

import json

import pytest
from tests.helpers.paths import WORKERS
from tests.helpers.torchrun_util import run_torchrun

WORKER = str(WORKERS / "probe_worker.py")
LAYOUTS = {
    "dp2_replicated": "dp=2,zero_stage=0",
    "dp2_fsdp": "dp=2,zero_stage=3",
    "tp2": "tp=2",
    "pp2": "pp=2",
}


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_probe_restores_its_state_exactly_under_every_two_process_layout() -> None:
    done = run_torchrun([WORKER, *(f"{name}:{spec}" for name, spec in LAYOUTS.items())], 2, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = {
        line["layout"]: line
        for line in (
            json.loads(raw.removeprefix("PROBE "))
            for raw in done.stdout.splitlines()
            if raw.startswith("PROBE ")
        )
    }
    assert set(results) == set(LAYOUTS), done.stdout[-2000:]
    for name, result in results.items():
        assert result["branches_equal"] and result["continues_as_plain"] and result["weights_equal"], (
            name,
            result,
        )
