"""The stage spec, the stage result, the metrics sinks and the loop's pure helpers (no process group)."""

from __future__ import annotations

import dataclasses
import json
import math
from io import StringIO
from pathlib import Path

import pytest
from tests.helpers.tiny import TINY_MODEL

from cona.config import parse_config
from cona.engine.metrics import (
    ConsoleSink,
    JsonlSink,
    TensorBoardSink,
    format_console_line,
    model_flops_utilization,
    peak_flops,
    scalars,
)
from cona.engine.spec import StageResult, StageSpec
from cona.engine.trainer import Progress, stop_rule_met
from cona.errors import ConfigError
from cona.runner.run_dir import resolve_log_root
from cona.strategy import Strategy

TINY = {
    "model": TINY_MODEL,
    "training": {"device": "cpu", "base_gbs": 8, "log_interval": 2, "eval_interval": 4, "eval_iters": 2},
}


def make_spec(tmp_path: Path, **overrides) -> StageSpec:
    # As the runner writes it: every path absolute (log_root too, see runner.run_dir.resolve_log_root).
    config = resolve_log_root(parse_config(TINY, source=tmp_path / ".conaconfig"))
    values = dict(
        run_dir=tmp_path / "run",
        config=config,
        strategy=Strategy(dp=2, tp=1, pp=1, mbs=2, gbs=8),
        stage=1,
        workdir=tmp_path / "work",
        planned_tokens=1000,
        target_iteration=5,
    )
    return StageSpec(**{**values, **overrides})


def record(**overrides) -> dict:
    base = dict(
        stage=1,
        iteration=10,
        consumed_samples=80,
        consumed_tokens=1280,
        loss=5.5,
        lr=1e-3,
        gbs=8,
        mbs=2,
        dp=2,
        tp=1,
        pp=1,
        step_time_s=0.25,
        tokens_per_s=5120.0,
        mfu=None,
        grad_norm=0.75,
        gns_small_sqr=2.0,
        gns_big_sqr=1.0,
        gns_small_batch=2,
        gns_big_batch=8,
        time=1.0e9,
    )
    return {**base, **overrides}


def test_spec_round_trips_through_json(tmp_path):
    spec = make_spec(
        tmp_path,
        load_path=tmp_path / "ckpt",
        max_tokens=4096,
        lr_factor=1.5,
        save_interval=3,
        strategy=Strategy(dp=1, tp=2, pp=2, mbs=1, gbs=8, zero_stage=3, pipeline_schedule="gpipe"),
    )
    path = spec.write(tmp_path / "spec.json")
    again = StageSpec.read(path)
    assert again == spec
    assert again.config.path == spec.config.path
    assert again.stage_dir == tmp_path / "run" / "stages" / "1"
    assert json.loads(path.read_text())["strategy"]["pipeline_schedule"] == "gpipe"


def test_spec_needs_a_stop_rule_and_a_known_version(tmp_path):
    with pytest.raises(ConfigError, match="stop rule"):
        make_spec(tmp_path, target_iteration=None)
    raw = make_spec(tmp_path).to_dict()
    raw["version"] = 99
    with pytest.raises(ConfigError, match="version 99"):
        StageSpec.from_dict(raw)
    with pytest.raises(ConfigError, match="does not exist"):
        StageSpec.read(tmp_path / "missing.json")


def test_spec_eval_settings_default_to_the_config(tmp_path):
    spec = make_spec(tmp_path)
    assert (spec.resolved_eval_interval(), spec.resolved_eval_iters()) == (4, 2)
    spec = make_spec(tmp_path, eval_interval=7, eval_iters=3)
    assert (spec.resolved_eval_interval(), spec.resolved_eval_iters()) == (7, 3)


def test_eval_every_tokens_keeps_the_spacing_in_tokens_at_every_gbs(tmp_path):
    spec = make_spec(tmp_path)
    config = dataclasses.replace(spec.config, training=spec.config.training.replace(eval_every_tokens=512))
    intervals = [
        make_spec(
            tmp_path, config=config, strategy=Strategy(dp=2, tp=1, pp=1, mbs=mbs, gbs=gbs)
        ).resolved_eval_interval()
        for mbs, gbs in ((1, 2), (2, 8), (4, 32), (4, 64))
    ]
    assert intervals == [16, 4, 1, 1]  # 512 tokens at seq 16: 32 samples, at least one step apart
    assert make_spec(tmp_path, config=config, eval_interval=7).resolved_eval_interval() == 7
    with pytest.raises(ConfigError, match="training.eval_every_tokens"):
        parse_config({**TINY, "training": {**TINY["training"], "eval_every_tokens": 0}})


def test_stage_result_round_trips(tmp_path):
    result = StageResult(
        stage=2,
        reason="switch_requested",
        last_iteration=7,
        consumed_samples=56,
        consumed_tokens=896,
        checkpoint="/x/global_step7",
        timings={"process_start": 1.0},
    )
    assert StageResult.read(result.write(tmp_path / "stage_result.json")) == result


def test_stop_rule_by_iteration_and_by_tokens(tmp_path):
    by_iter = make_spec(tmp_path, target_iteration=3)
    assert not stop_rule_met(by_iter, Progress(iteration=2))
    assert stop_rule_met(by_iter, Progress(iteration=3))
    by_tokens = make_spec(tmp_path, target_iteration=None, max_tokens=1000)
    assert not stop_rule_met(by_tokens, Progress(iteration=50, consumed_tokens=999))
    assert stop_rule_met(by_tokens, Progress(iteration=50, consumed_tokens=1000))


def test_progress_from_trainer_state():
    state = {"iteration": 4, "consumed_samples": 32, "consumed_tokens": 512, "stage": 1, "seed": 3}
    assert Progress.from_trainer_state(state) == Progress(
        iteration=4, consumed_samples=32, consumed_tokens=512
    )


def test_peak_flops_table_and_mfu():
    assert peak_flops("NVIDIA H200", "bf16") == 989e12
    assert peak_flops("NVIDIA H100 PCIe", "bf16") == 756e12
    assert peak_flops("NVIDIA L40S", "fp16") == 362e12
    assert peak_flops("NVIDIA L4", "bf16") == 121e12
    assert peak_flops("Tesla V100-SXM2-32GB", "bf16") is None  # no bf16 on Volta
    assert peak_flops(None, "fp32") is None and peak_flops("Some GPU", "bf16") is None
    assert model_flops_utilization(1000.0, 1e9, 1e12, 2) == pytest.approx(0.5)
    assert model_flops_utilization(1000.0, 1e9, None, 2) is None


def test_jsonl_sink_appends_lines_and_writes_nan_as_null(tmp_path):
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    sink.write(record())
    sink.write(record(iteration=20, loss=math.nan))
    sink.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["iteration"] for line in lines] == [10, 20]
    assert lines[1]["loss"] is None and lines[0]["loss"] == 5.5


def test_console_line_shows_the_main_numbers():
    line = format_console_line(record(mfu=0.4123, eval_loss=4.0, eval_ppl=math.exp(4.0)))
    for part in (
        "stage 1",
        "iter     10",
        "loss 5.5000",
        "5,120 tok/s",
        "mfu 41.2%",
        "eval 4.0000 ppl 54.60",
    ):
        assert part in line
    stream = StringIO()
    ConsoleSink(stream).write(record())
    assert "mfu" not in stream.getvalue() and "loss 5.5000" in stream.getvalue()


def test_scalars_skip_identifiers_and_missing_values():
    values = scalars(record(eval_loss=None, loss=math.inf))
    assert not {"train/iteration", "train/time", "train/stage"} & set(values)
    assert "eval/loss" not in values and "train/loss" not in values and "train/mfu" not in values
    assert values["train/grad_norm"] == 0.75


def test_the_trackers_tag_training_and_evaluation_scalars_apart():
    values = scalars(record(eval_loss=4.0, eval_ppl=math.exp(4.0)))
    assert values["train/loss"] == 5.5 and values["train/lr"] > 0
    assert values["eval/loss"] == 4.0 and values["eval/ppl"] == pytest.approx(math.exp(4.0))
    assert all(tag.startswith(("train/", "eval/")) for tag in values), values


def test_tensorboard_sink_writes_events(tmp_path):
    sink = TensorBoardSink(directory=str(tmp_path / "tb"), run_name="run1")
    sink.write(record(eval_loss=4.0))
    sink.close()
    (events,) = (tmp_path / "tb" / "run1").glob("events.out.tfevents.*")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = EventAccumulator(str(events)).Reload().Tags()["scalars"]
    assert "train/loss" in tags and "eval/loss" in tags and "loss" not in tags


def test_spec_is_frozen(tmp_path):
    with pytest.raises(dataclasses.FrozenInstanceError):
        make_spec(tmp_path).stage = 2


def test_a_divergence_finishes_the_periodic_save_in_flight_or_says_it_was_dropped(monkeypatch):
    """Every rank stops at the same metrics line, so the save of the earlier state in flight is finished
    (published) before the divergence ends the stage, instead of leaving an empty temporary and no word."""
    from types import SimpleNamespace

    from cona.engine import trainer
    from cona.errors import CheckpointError, TrainingDiverged

    closed = []

    class Saves:
        def __init__(self, fails: bool) -> None:
            self.fails = fails

        def close(self) -> None:
            closed.append(self.fails)
            if self.fails:
                raise CheckpointError("saving checkpoint global_step8 failed on rank 0: disk full")

    def diverge(ctx, progress):
        raise TrainingDiverged("training diverged at iteration 10: mean loss 90 is over 10x the lowest")

    monkeypatch.setattr(trainer, "_train_steps", diverge)
    with pytest.raises(TrainingDiverged, match=r"^training diverged at iteration 10: mean loss 90 [^;]*$"):
        trainer.train_stage(SimpleNamespace(periodic=Saves(fails=False), divergence=None), Progress())
    dropped = r"^training diverged at iteration 10: .*; the periodic save in flight was dropped: saving"
    with pytest.raises(TrainingDiverged, match=dropped):
        trainer.train_stage(SimpleNamespace(periodic=Saves(fails=True), divergence=None), Progress())
    assert closed == [False, True]
