"""The metrics record: both writers produce the same schema, and the JSON on disk is what it was."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from cona.backends.megatron_deepspeed.log_parse import MetricsRecorder
from cona.engine.metrics import JsonlSink
from cona.metrics_record import ALWAYS_WRITTEN, MetricsRecord, read_metrics, stage_rates, steady_rates
from cona.strategy import Strategy

# A native trainer line as it was written before the record existed (key order included).
TRAINER_LINE = (
    '{"stage": 1, "iteration": 5, "consumed_samples": 10, "consumed_tokens": 80, "loss": 3.25, "lr": 0.001, '
    '"gbs": 2, "mbs": 1, "dp": 2, "tp": 1, "pp": 1, "step_time_s": 0.5, "tokens_per_s": 32.0, "mfu": null, '
    '"grad_norm": 0.5, "gns_small_sqr": null, "gns_big_sqr": 1.5, "gns_small_batch": 1, "gns_big_batch": 2, '
    '"steps_in_interval": 5, "skipped_steps": 0, "time": 1700000000.0, "eval_loss": 3.0, '
    '"eval_ppl": 20.085536923187668, "eval_ppl_tokens": "masked"}'
)


def test_a_record_writes_the_line_the_trainer_wrote(tmp_path: Path) -> None:
    old = json.loads(TRAINER_LINE)
    record = MetricsRecord.from_dict({key: old[key] for key in ALWAYS_WRITTEN})
    record = record.with_evaluation(3.0, masked_tokens=True)
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    sink.write(record.to_dict())
    sink.close()
    assert (tmp_path / "metrics.jsonl").read_text() == TRAINER_LINE + "\n"
    assert MetricsRecord.from_dict(old) == record


def test_a_diverged_evaluation_is_an_infinite_perplexity() -> None:
    record = MetricsRecord(stage=1, iteration=1).with_evaluation(800.0)
    assert record.eval_ppl == math.inf and "eval_ppl_tokens" not in record.to_dict()


def test_the_megatron_parser_writes_the_trainers_keys_and_its_backend() -> None:
    written: list[dict] = []
    recorder = MetricsRecorder(
        stage=1, strategy=Strategy(dp=1, tp=1, pp=2, mbs=1, gbs=4), seq=64, write=written.append
    )
    recorder.feed(
        " iteration        3/      12 | consumed samples:           12 | consumed tokens:          768 |"
        " elapsed time per iteration (ms): 7193.6 | learning rate: 4.909E-03 | global batch size:     4 |"
        " lm loss: 1.084810E+01 | grad norm: 1.722 | number of skipped iterations:   0 |"
    )
    recorder.feed(" validation loss at iteration 3 | lm loss value: 1.067690E+01 | lm loss PPL: 4.3E+04 |")
    recorder.flush()
    [line] = written
    assert list(line) == ["backend", *ALWAYS_WRITTEN, "eval_loss", "eval_ppl"]
    assert line["backend"] == "megatron-deepspeed" and line["gns_small_sqr"] is None and line["mfu"] is None
    assert recorder.last == line


def test_reading_is_lenient_about_missing_and_unknown_keys() -> None:
    record = MetricsRecord.from_dict({"iteration": 3, "tokens_per_s": 10.0, "zero_stage": 2})
    assert record.iteration == 3 and record.stage is None and record.loss is None
    assert record.extra == {"zero_stage": 2}
    assert list(record.to_dict())[-1] == "zero_stage"  # an unknown key is written back, after the known ones


def test_a_line_with_several_measured_steps_lists_them_after_the_fixed_keys() -> None:
    record = MetricsRecord(iteration=8, gns_small_sqr=2.0, gns_big_sqr=1.0, gns_steps=[[1.0, 0.5], [3, 1.5]])
    line = record.to_dict()
    assert list(line)[len(ALWAYS_WRITTEN)] == "gns_steps" and MetricsRecord.from_dict(line) == record
    assert "gns_steps" not in MetricsRecord(iteration=8).to_dict()


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("iteration", "3"),
        ("loss", True),
        ("backend", 1),
        ("gns_steps", [[1.0]]),
        ("gns_steps", [[1.0, None]]),
    ],
)
def test_a_known_key_of_the_wrong_type_is_refused_by_name(key, value) -> None:
    with pytest.raises(ValueError, match=f"metrics record: {key} is"):
        MetricsRecord.from_dict({"iteration": 1, key: value})


def test_read_metrics_skips_torn_and_foreign_lines(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"iteration": 1}\n{"iteration": "two"}\n[3]\n{"iteration": 4}\n{"iter')
    assert [record.iteration for record in read_metrics(path)] == [1, 4]


def test_a_stage_s_steady_rates_leave_out_its_first_line_and_a_warm_up_after_it():
    # A compiled switch to mbs 32 (GPT-350M, H200): 67.5k, 74.4k, then 184k tokens/s.
    assert steady_rates([67_506.0, 74_448.0, 184_033.0, 180_000.0]) == [184_033.0, 180_000.0]
    assert steady_rates([1.0, 10.0, 20.0, 40.0]) == [40.0]  # each leading line 2x slower than the next
    # Eager host-bound lines scatter (1.37x here): not warm-up, and a slow line later on stays.
    assert steady_rates([50.0, 30.0, 41.0, 33.0]) == [30.0, 41.0, 33.0]
    assert steady_rates([50.0, 100.0, 40.0]) == [100.0, 40.0]
    assert steady_rates([50.0, 40.0]) == [40.0]  # one line: nothing to compare it with
    assert steady_rates([50.0]) == [] and steady_rates([]) == []


def test_a_stage_s_rates_leave_out_the_short_last_line_a_switch_forced():
    def line(steps: int, rate: float) -> MetricsRecord:
        return MetricsRecord(stage=1, steps_in_interval=steps, tokens_per_s=rate)

    # GPT-125M gbs 8 eager on the H200: the 3-step line the switch forced ran no noise-measuring step and
    # 1.7x faster than the full line before it.
    lines = [line(8, 21_788.0), line(8, 95_395.0), line(3, 161_658.0)]
    assert stage_rates(lines) == [21_788.0, 95_395.0]
    assert steady_rates(stage_rates(lines)) == [95_395.0]
    # A first line, then the 2-step line a switch forced: nothing measured.
    assert steady_rates(stage_rates([line(8, 31_926.0), line(2, 194_678.0)])) == []
    assert stage_rates(lines[:2]) == [21_788.0, 95_395.0] and stage_rates(lines[:1]) == [21_788.0]
    assert stage_rates([line(6, 1.0), line(8, 2.0)]) == [1.0, 2.0]  # a short first line stays
