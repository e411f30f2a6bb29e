"""The default search: exhaustive while the space is small, BO above the threshold; the flags force one."""

from __future__ import annotations

import json

import pytest

from cona.cli import main
from cona.config import ModelConfig
from cona.planner import search_choice
from cona.planner.search_choice import EXHAUSTIVE_UP_TO, search_strategies, uses_botorch
from cona.planner.space import SpaceOptions, enumerate_strategies
from cona.planner.systems import load_system
from cona.runner.run_descriptions import OnlineRun

GPT_1_3B = ModelConfig(layers=24, hidden=2048, heads=16, seq=2048, vocab_size=50257)
SMALL_SPACE = SpaceOptions(zero_stages=(1, 3), recompute=("none", "full"), sequence_parallel=(False,))
FAST_BO = {"max_gp_updates": 1, "max_local_rounds": 0}


def test_the_threshold_and_the_forcing_flags():
    assert not uses_botorch(EXHAUSTIVE_UP_TO, None) and uses_botorch(EXHAUSTIVE_UP_TO + 1, None)
    assert uses_botorch(10, True) and not uses_botorch(10 * EXHAUSTIVE_UP_TO, False)


def test_the_default_search_follows_the_size_of_the_space(monkeypatch):
    a100 = load_system("a100_80g")
    size = len(enumerate_strategies(GPT_1_3B, 8, 64, gpus_per_node=8, options=SMALL_SPACE))
    assert 10 < size <= EXHAUSTIVE_UP_TO
    found = search_strategies(GPT_1_3B, a100, 8, 64, options=SMALL_SPACE, top_k=3)
    assert found.method == "exhaustive" and found.evaluations == found.space_size == size
    monkeypatch.setattr(search_choice, "EXHAUSTIVE_UP_TO", size - 1)  # the same space is now "large"
    larger = search_strategies(GPT_1_3B, a100, 8, 64, options=SMALL_SPACE, top_k=3, **FAST_BO)
    assert larger.method == "bayesian" and larger.evaluations < size
    forced = search_strategies(GPT_1_3B, a100, 8, 64, options=SMALL_SPACE, botorch=False, top_k=3)
    assert forced.method == "exhaustive"


def test_botorch_and_exhaustive_together_are_a_usage_error(tmp_path, capsys):
    path = tmp_path / ".conaconfig"
    path.write_text(
        json.dumps({"model": {"layers": 2, "hidden": 64, "heads": 4, "seq": 32, "vocab_size": 99}})
    )
    args = ["strategies", "--gpus", "2", "--system", "a100_80g", "--gbs", "4", "--config", str(path)]
    assert main([*args, "--botorch", "--exhaustive"]) == 2
    assert "--botorch and --exhaustive" in capsys.readouterr().err


@pytest.mark.parametrize(("botorch", "flags"), [(None, []), (True, ["--botorch"]), (False, ["--exhaustive"])])
def test_the_other_nodes_get_the_same_choice(tmp_path, botorch, flags):
    run = OnlineRun(
        config=None, workdir=tmp_path, run_dir=tmp_path, world_size=2, device_type="cpu", system="cpu_gloo",
        initial_gbs=2, max_gbs=4, total_iters=3, botorch=botorch,
    )  # fmt: skip
    base = ["--system", "cpu_gloo", "--initial-gbs", "2", "--max-gbs", "4", "--total-iters", "3"]
    assert run.mode_args() == [*base, *flags]
