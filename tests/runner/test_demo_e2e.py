"""``cona demo`` as a new user runs it (4 CPU processes, the demo data): it switches on its own measurements.

No noise-scale floor: every switch decision rests on the noise scale and throughputs the run measured.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

DEMO_DATA = Path(__file__).resolve().parents[2] / "data" / "demo"


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.skipif(not (DEMO_DATA / "tiny-vocab.json").is_file(), reason="needs scripts/install.sh")
def test_cona_demo_switches_on_measured_values(tmp_path):
    command = [sys.executable, "-m", "cona", "demo", "--out", str(tmp_path), "--quiet"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "decisions assume a noise scale" not in done.stdout  # the floor is gone
    (run_dir,) = tmp_path.glob("*/logs/online")
    decisions = [json.loads(line) for line in (run_dir / "decisions.jsonl").read_text().splitlines()]
    switches = [d for d in decisions if d["decision"] in ("switch", "fallback")]
    assert switches, [d["reason"] for d in decisions[-3:]]
    for decision in switches:
        assert decision["noise_scale"] is not None and "noise_scale_floor" not in decision
        assert decision["current"]["measured_tokens_per_s"] > 0
    stages = json.loads((run_dir / "online_stages.json").read_text())
    # A request the workers' last step boundary missed (the search was still deciding) is logged as not
    # carried out; it can only be the last stage's.
    late = [d for d in decisions if d["decision"] == "not_carried_out"]
    assert all(d["stage"] == len(stages) for d in late), late
    assert len(stages) == len(switches) - len(late) + 1
