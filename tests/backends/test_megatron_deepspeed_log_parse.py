"""Megatron-DeepSpeed stdout -> metrics records, on lines recorded from real runs (6acc370a, CPU, tp1/pp2)."""

from __future__ import annotations

import math

import pytest

from cona.backends.megatron_deepspeed.log_parse import (
    MetricsRecorder,
    parse_evaluation_line,
    parse_training_line,
)
from cona.strategy import Strategy

# Lines recorded from real runs at 6acc370a (CPU, tp1/pp2, 2 layers, hidden 64, seq 64, gbs 4), with a
# neighbouring line of Megatron's that the parser must ignore. DURING: log interval 1, eval interval 4.
DURING = """\
[before the start of training step] datetime: 2026-11-29 11:53:19 
 iteration        3/      12 | consumed samples:           12 | consumed tokens:          768 | elapsed time per iteration (ms): 7193.6 | learning rate: 4.909E-03 | global batch size:     4 | lm loss: 1.084810E+01 | loss scale: 1.0 | grad norm: 1.722 | num zeros: 0.0 | actual seqlen:    64 | number of skipped iterations:   0 | number of nan iterations:   0 | samples per second: 0.556 | tokens per gpu per second (tgs): 17.794 | TFLOPs: 0.00 |
 iteration        4/      12 | consumed samples:           16 | consumed tokens:         1024 | elapsed time per iteration (ms): 5150.5 | learning rate: 4.643E-03 | global batch size:     4 | lm loss: 1.076975E+01 | loss scale: 1.0 | grad norm: 1.500 | num zeros: 0.0 | actual seqlen:    64 | number of skipped iterations:   0 | number of nan iterations:   0 | samples per second: 0.777 | tokens per gpu per second (tgs): 24.852 | TFLOPs: 0.00 |
--------------------------------------------------
 validation loss at iteration 4 | lm loss value: 1.067690E+01 | lm loss PPL: 4.334289E+04 | 
--------------------------------------------------
 iteration        5/      12 | consumed samples:           20 | consumed tokens:         1280 | elapsed time per iteration (ms): 5817.6 | learning rate: 4.223E-03 | global batch size:     4 | lm loss: 1.065823E+01 | loss scale: 1.0 | grad norm: 1.059 | num zeros: 0.0 | actual seqlen:    64 | number of skipped iterations:   0 | number of nan iterations:   0 | samples per second: 0.688 | tokens per gpu per second (tgs): 22.002 | TFLOPs: 0.00 |
"""  # noqa: E501, W291
# FINAL: the end of a stage that stops by --train-tokens: save, then the final validation and test draws.
FINAL = """\
 iteration        4/      24 | consumed samples:           16 | consumed tokens:         1024 | elapsed time per iteration (ms): 4403.9 | learning rate: 4.805E-03 | global batch size:     4 | lm loss: 1.076975E+01 | loss scale: 1.0 | grad norm: 1.500 | num zeros: 0.0 | actual seqlen:    64 | number of skipped iterations:   0 | number of nan iterations:   0 | samples per second: 0.908 | tokens per gpu per second (tgs): 29.065 | TFLOPs: 0.00 |
[after training is done] datetime: 2026-11-29 12:02:58 
  successfully saved checkpoint at iteration       4 to /runs/work/checkpoints/gpt-mds/z1/fp32/tp1_pp2_dp1_sp1
 validation loss at iteration 4 on 8-sample draw from validation set | lm loss value: 1.067650E+01 | lm loss PPL: 4.332549E+04 | 
 validation loss at iteration 4 on 8-sample draw from test set | lm loss value: 1.069993E+01 | lm loss PPL: 4.435276E+04 | 
"""  # noqa: E501, W291


def _recorder(records: list[dict]) -> MetricsRecorder:
    strategy = Strategy(dp=1, tp=1, pp=2, mbs=1, gbs=4)
    return MetricsRecorder(stage=2, strategy=strategy, seq=64, write=records.append, previous_iteration=2)


def test_training_line_numbers():
    values = parse_training_line(DURING.splitlines()[1])
    assert values == {
        "iteration": 3,
        "train_iters": 12,
        "consumed_samples": 12.0,
        "consumed_tokens": 768.0,
        "step_time_ms": 7193.6,
        "lr": 4.909e-3,
        "gbs": 4.0,
        "loss": 10.8481,
        "grad_norm": 1.722,
        "skipped": 0.0,
    }


def test_other_lines_are_not_training_lines():
    for line in DURING.splitlines():
        if " iteration " not in line or "lm loss:" not in line:
            assert parse_training_line(line) is None


def test_evaluation_lines_during_and_after_training():
    during = parse_evaluation_line(DURING.splitlines()[4])
    assert (during.iteration, during.split, during.samples, during.loss) == (4, "validation", None, 10.6769)
    final = FINAL.splitlines()
    validation, test = parse_evaluation_line(final[3]), parse_evaluation_line(final[4])
    assert (validation.iteration, validation.split, validation.samples, validation.loss) == (
        4,
        "validation",
        8,
        10.6765,
    )
    assert (test.iteration, test.split, test.samples, test.loss) == (4, "test", 8, 10.69993)
    assert parse_evaluation_line(final[0]) is None and parse_evaluation_line(final[2]) is None


def test_records_carry_the_native_keys_and_the_evaluation_of_their_iteration():
    records: list[dict] = []
    recorder = _recorder(records)
    for line in DURING.splitlines():
        recorder.feed(line)
    recorder.flush()
    assert [record["iteration"] for record in records] == [3, 4, 5]
    third, fourth, fifth = records
    assert third["steps_in_interval"] == 1 and third["stage"] == 2
    assert third["step_time_s"] == pytest.approx(7.1936)
    assert third["tokens_per_s"] == pytest.approx(4 * 64 / 7.1936)
    assert (third["dp"], third["tp"], third["pp"], third["gbs"], third["mbs"]) == (1, 1, 2, 4, 1)
    assert fourth["eval_loss"] == 10.6769 and fourth["eval_ppl"] == pytest.approx(math.exp(10.6769))
    assert fifth["consumed_tokens"] == 1280 and fifth["loss"] == 10.65823 and "eval_loss" not in fifth
    assert all(record["gns_small_sqr"] is None for record in records)  # Megatron reports no GNS inputs


def test_the_final_draws_are_kept_for_verification_not_put_in_a_training_record():
    records: list[dict] = []
    recorder = _recorder(records)
    for line in FINAL.splitlines():
        recorder.feed(line)
    recorder.flush()
    assert [record["iteration"] for record in records] == [4]
    assert "eval_loss" not in records[0] and records[0]["steps_in_interval"] == 2
    assert [(e.split, e.samples, e.loss) for e in recorder.evaluations] == [
        ("validation", 8, 10.6765),
        ("test", 8, 10.69993),
    ]


def test_a_record_is_held_back_until_its_evaluation_could_follow():
    records: list[dict] = []
    recorder = _recorder(records)
    lines = DURING.splitlines()
    recorder.feed(lines[2])  # iteration 4
    assert records == []
    recorder.feed(lines[4])  # its evaluation
    recorder.feed(lines[6])  # iteration 5 releases iteration 4
    assert [record["iteration"] for record in records] == [4]
    assert records[0]["eval_loss"] == 10.6769


def training_line(iteration: int, samples: int, gbs: int, loss: float) -> str:
    """A training line in the recorded lines' format (field widths and all)."""
    return (
        f" iteration {iteration:>8}/      12 | consumed samples: {samples:>12} | consumed tokens: "
        f"{samples * 64:>12} | elapsed time per iteration (ms): 500.0 | learning rate: 4.909E-03 | "
        f"global batch size: {gbs:>5} | lm loss: {loss:.6E} | loss scale: 1.0 | grad norm: 1.722 | "
        "number of skipped iterations:   0 | number of nan iterations:   0 |"
    )


def test_log_interval_2_with_a_gbs_change_and_an_evaluation_between_log_lines():
    """Log interval 2, an evaluation at iteration 5 (between the lines of 4 and 6), and Megatron's gbs 8 where
    the stage's strategy says 4: the records take Megatron's gbs, and the evaluation of iteration 5 goes
    into no record of another iteration."""
    records: list[dict] = []
    recorder = _recorder(records)
    lines = [
        training_line(4, 16, 4, 10.8),
        " validation loss at iteration 5 | lm loss value: 1.067690E+01 | lm loss PPL: 4.334289E+04 | ",
        training_line(6, 32, 8, 10.7),
        training_line(8, 48, 8, 10.6),
        " validation loss at iteration 8 | lm loss value: 1.050000E+01 | lm loss PPL: 3.631550E+04 | ",
    ]
    for line in lines:
        recorder.feed(line)
    recorder.flush()
    assert [(r["iteration"], r["gbs"], r["steps_in_interval"]) for r in records] == [
        (4, 4, 2),
        (6, 8, 2),
        (8, 8, 2),
    ]
    assert records[1]["tokens_per_s"] == pytest.approx(8 * 64 / 0.5)
    assert [r.get("eval_loss") for r in records] == [None, None, 10.5]
    assert [e.iteration for e in recorder.evaluations] == [5, 8]
