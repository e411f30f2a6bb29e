"""``cona train --chain FILE --switch-in-place``: a chain step that keeps the layout continues the state in
the workers' memory (a real 2-process chain of the tiny GPT on CPU in one worker session), trains what the
checkpointed chain trains, still checkpoints the layout change, and after a kill retrains what memory lost."""

from __future__ import annotations

import json
import shutil

import pytest
from tests.helpers.observed import TRACE_ENV, assert_each_sample_once_in_order
from tests.helpers.tiny_runs import free_port_base, write_chain

from cona.cli import main
from cona.engine.spec import StageSpec
from cona.metrics_record import read_metrics
from cona.runner.state import load_state

STEPS = [
    {"dp": 2, "tp": 1, "pp": 1, "gbs": 8, "mbs": 4, "train_iters": 3, "is_initial": True},
    {"dp": 2, "tp": 1, "pp": 1, "gbs": 16, "mbs": 4, "extra_iters": 3},  # the same layout: in place
    {"dp": 1, "tp": 2, "pp": 1, "gbs": 16, "mbs": 4, "extra_iters": 2},  # another layout: a checkpoint
]
TOTAL_SAMPLES = 3 * 8 + 3 * 16 + 2 * 16


def losses(run_dir) -> dict[int, float]:
    """Each iteration's last logged loss (a retrained iteration is logged again)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {record["iteration"]: record["loss"] for record in records}


def train(tmp_path, config, chain, run_name: str, *extra: str) -> int:
    argv = ["train", "--chain", str(chain), "--config", str(config), "--gpus", "2", "--quiet"]
    argv += ["--workdir", str(tmp_path / run_name), "--run-name", run_name]
    return main([*argv, "--master-port-base", str(free_port_base(len(STEPS))), *extra])


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_chain_step_keeping_the_layout_switches_in_place_and_trains_as_the_checkpointed_chain(
    tmp_path, monkeypatch, capfd, tiny_config_file
):
    for name, value in TRACE_ENV.items():
        monkeypatch.setenv(name, value)
    config = tiny_config_file(data="markov")
    chain = write_chain(tmp_path / "chain.json", STEPS)
    assert train(tmp_path, config, chain, "inplace", "--switch-in-place") == 0
    assert "stage 2: dp2/tp1/pp1 mbs4 gbs16, iterations 3->6" in capfd.readouterr().out
    assert train(tmp_path, config, chain, "checkpointed") == 0

    run_dir, checkpointed_dir = tmp_path / "logs" / "inplace", tmp_path / "logs" / "checkpointed"
    state, checkpointed = load_state(run_dir), load_state(checkpointed_dir)
    assert [stage.status for stage in state.stages] == ["done"] * 3
    assert state.stages[0].checkpoint is None  # handed over: nothing saved at the switch
    assert state.stages[1].load_path is None and state.stages[1].checkpoint is not None  # saved for tp2
    assert state.stages[2].load_path == state.stages[1].checkpoint
    assert StageSpec.read(run_dir / "stages" / "2" / "spec.json").continue_in_place
    assert not StageSpec.read(run_dir / "stages" / "3" / "spec.json").continue_in_place
    assert all(stage.checkpoint is not None for stage in checkpointed.stages)
    assert state.stages[2].switch_check is not None  # the layout change is verified as before
    assert_each_sample_once_in_order(run_dir, total_samples=TOTAL_SAMPLES)
    in_place = losses(run_dir)
    assert sorted(in_place) == list(range(1, 9))
    # Each stage's first step runs a shape first: stage 1 measures the noise on every step (a line per step),
    # as pieces of 2 rows; stage 2's two micro-batches of 4 rows; stage 3 a new model (tp 2). Once each.
    lines = read_metrics(run_dir / "metrics.jsonl")
    assert [line.warmup_steps for line in lines] == [1, None, None, 1, None, None, 1, None]
    assert list(in_place.values()) == pytest.approx(list(losses(checkpointed_dir).values()), rel=1e-6)
    assert {"probe_s", "publish_s", "verify_s"}.isdisjoint(state.stages[1].switch_cost), state.stages[
        1
    ].switch_cost

    # A kill in stage 2 before it saved loses the state stage 1 handed over: the same command retrains
    # stage 1 up to the switch, continues stage 2 in place and finishes, with the same samples and losses.
    state_path = run_dir / "runner_state.json"
    books = json.loads(state_path.read_text())
    for stage in books["stages"][1:]:
        stage.update(status="running" if stage["step_num"] == 2 else "pending", checkpoint=None)
        stage.update(last_iteration=None, consumed_samples=None, consumed_tokens=None, switch_cost={})
    books["stages"][2].update(attempts=0, start_iteration=None, target_iteration=None, load_path=None)
    books["stages"][2].update(planned_at=None, switch_check=None, universal=None, timings={})
    state_path.write_text(json.dumps(books))
    for stage in (2, 3):
        (run_dir / "stages" / str(stage) / "stage_result.json").unlink()
    for checkpoint in (tmp_path / "inplace" / "checkpoints").rglob("global_step*"):
        shutil.rmtree(checkpoint)
    for marker in (tmp_path / "inplace" / "checkpoints").rglob("latest"):
        marker.unlink()
    capfd.readouterr()
    assert train(tmp_path, config, chain, "inplace", "--switch-in-place") == 0
    out = capfd.readouterr().out
    assert "stage 1: retraining iterations 0..3 to rebuild the state an in-place switch kept" in out
    resumed = load_state(run_dir)
    assert [stage.status for stage in resumed.stages] == ["done"] * 3
    assert resumed.stages[-1].consumed_samples == TOTAL_SAMPLES
    assert_each_sample_once_in_order(run_dir, total_samples=TOTAL_SAMPLES)
    assert list(losses(run_dir).values()) == pytest.approx(list(in_place.values()), rel=1e-6)


def test_switch_in_place_goes_with_a_chain(capsys):
    for mode in (["--dp", "2"], ["--gpus", "2"]):
        assert main(["train", "--switch-in-place", *mode]) == 2
        assert "cona train: --switch-in-place goes with --chain" in capsys.readouterr().err


def test_switch_in_place_needs_the_workers_kept_between_stages(tmp_path, capsys, tiny_config_file):
    config = tiny_config_file(data="markov")
    chain = write_chain(tmp_path / "chain.json", STEPS)
    assert train(tmp_path, config, chain, "restarted", "--switch-in-place", "--restart-workers") == 2
    assert "--switch-in-place needs the worker processes kept from one stage to the next" in (
        capsys.readouterr().err
    )
    assert not (tmp_path / "logs" / "restarted").exists()  # refused before anything started
