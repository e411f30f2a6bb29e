"""The switch check's comparison (pure), its records in a checkpoint and in a stage directory, and the
runner's reading of a refused check."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from tests.helpers.tiny import tiny_config
from torch import nn

from cona.engine.checkpoint.info import PROBE_FILE, read_checkpoint_info
from cona.engine.checkpoint.save import save_checkpoint
from cona.engine.switch_check import (
    PROBE_ATOL,
    PROBE_RTOL,
    VERDICT_FILE,
    ProbeRecord,
    compare_probe,
    probe_tolerance,
    read_verdict,
    write_verdict,
)
from cona.errors import CheckpointError, LaunchError
from cona.strategy import Strategy

SAVED = ProbeRecord(
    loss=4.0,
    dtype="fp32",
    layout="dp1/tp2/pp1 mbs4 gbs8",
    iteration=30,
    split="valid",
    sample_ids=(0, 1, 2, 3),
    tokens_sha256="ab" * 32,
    seconds=0.05,
)


def loaded(loss: float, **changes) -> ProbeRecord:
    return dataclasses.replace(SAVED, loss=loss, layout="dp1/tp1/pp2 mbs4 gbs8", seconds=0.07, **changes)


def test_tolerance_is_relative_to_the_loss_and_the_loosest_dtype_decides():
    assert probe_tolerance(4.0, 4.0, ("fp32",)) == pytest.approx(4.0 * 2e-5 + PROBE_ATOL)
    assert PROBE_RTOL["fp32"] < PROBE_RTOL["fp16"] < PROBE_RTOL["bf16"]
    assert probe_tolerance(4.0, 2.0, ("fp32", "bf16")) == pytest.approx(4.0 * PROBE_RTOL["bf16"] + PROBE_ATOL)
    with pytest.raises(CheckpointError, match="no probe tolerance for dtype 'int8'"):
        probe_tolerance(1.0, 1.0, ("int8",))


def test_losses_within_float_noise_pass_and_beyond_it_fail():
    just_inside = 4.0 * (1 + PROBE_RTOL["fp32"] * 0.9)
    verdict = compare_probe(SAVED, loaded(just_inside), checkpoint="ckpt")
    assert verdict.status == "passed" and verdict.passed
    assert verdict.difference == pytest.approx(just_inside - 4.0)
    assert verdict.message().startswith("switch check passed for ckpt: probe loss 4 saved under dp1/tp2/pp1")

    refused = compare_probe(SAVED, loaded(4.01), checkpoint="ckpt")
    assert refused.status == "failed" and not refused.passed
    message = refused.message()
    assert message.startswith("switch verification refused checkpoint ckpt: probe loss 4 saved under ")
    for part in ("dp1/tp2/pp1 mbs4 gbs8 (fp32, iteration 30)", "4.01 after loading under dp1/tp1/pp2"):
        assert part in message
    assert "differ by 0.01," in message and "No training step was taken" in message

    # The same numbers pass in bf16, whose rounding is far coarser.
    bf16 = compare_probe(dataclasses.replace(SAVED, dtype="bf16"), loaded(4.01, dtype="bf16"), checkpoint="c")
    assert bf16.status == "passed"


DOCUMENTED_RTOL = {"fp32": 2e-5, "fp16": 5e-3, "bf16": 2e-2}  # the bounds switch_check.py argues for


@pytest.mark.parametrize("dtype", sorted(DOCUMENTED_RTOL))
@pytest.mark.parametrize("factor", [0.95, 1.05], ids=["just below", "just above"])
def test_a_difference_just_past_the_tolerance_fails_and_just_inside_it_passes(dtype, factor):
    saved = dataclasses.replace(SAVED, dtype=dtype)
    bound = DOCUMENTED_RTOL[dtype] * 4.0 + PROBE_ATOL  # relative to the larger loss: the saved one here
    after = loaded(4.0 - factor * bound, dtype=dtype)
    verdict = compare_probe(saved, after, checkpoint="c")
    assert verdict.tolerance == pytest.approx(bound)
    assert verdict.status == ("passed" if factor < 1 else "failed")


def test_a_loss_that_is_not_finite_fails():
    assert compare_probe(SAVED, loaded(math.nan), checkpoint="c").status == "failed"
    diverged = compare_probe(dataclasses.replace(SAVED, loss=math.inf), loaded(4.0), checkpoint="c")
    assert diverged.status == "failed" and diverged.difference == math.inf


def test_nothing_to_compare_is_skipped_not_failed():
    no_probe = compare_probe(None, loaded(9.0), checkpoint="old")
    assert no_probe.status == "skipped" and no_probe.passed
    assert no_probe.message() == "switch check skipped for old: the checkpoint records no probe loss"


def test_a_probe_batch_the_data_no_longer_holds_fails():
    other_data = compare_probe(SAVED, loaded(4.0, tokens_sha256="cd" * 32), checkpoint="c")
    assert other_data.status == "failed" and not other_data.passed
    assert other_data.message() == (
        "switch verification refused checkpoint c: its probe batch (valid samples [0, 1, 2, 3], sha256 "
        "abababababab) is not in this run's data, which has valid samples [0, 1, 2, 3] with sha256 "
        "cdcdcdcdcdcd there: the data files changed since it was saved, so its weights cannot be verified. "
        "No training step was taken"
    )


def test_verdict_round_trips_through_its_file(tmp_path):
    verdict = compare_probe(SAVED, loaded(5.0), checkpoint="c")
    path = write_verdict(tmp_path, verdict)
    assert path == tmp_path / VERDICT_FILE
    assert read_verdict(tmp_path) == verdict
    assert read_verdict(tmp_path, newer_than=path.stat().st_mtime + 10) is None
    assert read_verdict(tmp_path / "none") is None
    path.write_text('{"status": "fail')  # what a killed worker may leave
    assert read_verdict(tmp_path) is None
    with pytest.raises(CheckpointError, match="probe record lacks loss"):
        ProbeRecord.from_dict({k: v for k, v in SAVED.to_dict().items() if k != "loss"})


def test_a_checkpoint_carries_its_probe(tmp_path):
    config = tiny_config()
    model = nn.Linear(2, 2)
    arguments = dict(
        iteration=3,
        model_parts=[model],
        optimizer=torch.optim.AdamW(model.parameters()),
        trainer_state={"iteration": 3, "consumed_samples": 24, "consumed_tokens": 96},
        config=config,
        strategy=Strategy(dp=1, tp=1, pp=1, mbs=1, gbs=8),
    )
    with_probe = save_checkpoint(tmp_path / "a", **arguments, probe=SAVED.to_dict())
    assert json.loads((with_probe / PROBE_FILE).read_text()) == SAVED.to_dict()
    assert ProbeRecord.from_dict(read_checkpoint_info(with_probe).probe) == SAVED
    assert read_checkpoint_info(save_checkpoint(tmp_path / "b", **arguments)).probe is None


def test_the_runner_reports_a_refused_check_as_a_checkpoint_error(tmp_path):
    from cona.runner.stage_run import StageLaunch, launch_stage

    spec = type(
        "Spec",
        (),
        {"stage_dir": tmp_path / "stages" / "2", "stage": 2, "run_dir": tmp_path, "load_path": None},
    )()
    launch = StageLaunch(spec=spec, spec_path=tmp_path / "spec.json", topology=None, device_type="cpu")

    def refuses(_launch):
        write_verdict(spec.stage_dir, compare_probe(SAVED, loaded(5.0), checkpoint="ckpt"))
        raise LaunchError("stage 2: rank 0 failed: CheckpointError: ...")

    with pytest.raises(CheckpointError) as refused:
        launch_stage(refuses, launch)
    message = str(refused.value)
    assert message.startswith("stage 2: switch verification refused checkpoint ckpt: probe loss 4 saved")
    assert "Rerunning the same command verifies it again" in message

    def fails_otherwise(_launch):  # the earlier attempt's refusal is not this failure's cause
        raise LaunchError("stage 2: rank 1 failed: RuntimeError: out of memory")

    write_verdict(spec.stage_dir, compare_probe(SAVED, loaded(9.0), checkpoint="old attempt"))
    with pytest.raises(LaunchError, match="out of memory"):
        launch_stage(fails_otherwise, launch)
    assert not Path(spec.stage_dir, VERDICT_FILE).exists()
    assert launch_stage(lambda _launch: None, launch) > 0


def test_a_tensor_far_from_its_saved_magnitude_fails_even_when_the_probe_loss_agrees():
    """16 weights at 1e20 in an embedding row the probe batch never reads leave its loss as it was: the
    per-tensor magnitudes recorded at save time refuse them, as they refuse a NaN."""
    from cona.engine.probe import tensor_max_abs

    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 2))
    with torch.no_grad():
        model[0].weight.uniform_(-0.5, 0.5)
    saved = dataclasses.replace(SAVED, tensor_max_abs=tensor_max_abs([model]))
    assert sorted(saved.tensor_max_abs) == ["0.weight", "1.bias", "1.weight"]
    assert saved.tensor_max_abs["0.weight"] == pytest.approx(model[0].weight.abs().max().item())
    same = compare_probe(saved, loaded(4.0, tensor_max_abs=tensor_max_abs([model])), checkpoint="ckpt")
    assert same.status == "passed"
    for planted, expected in (
        (1e20, "holds values up to 1e+20 in magnitude"),
        (math.nan, "holds values up to nan"),
    ):
        with torch.no_grad():
            kept = model[0].weight.detach().clone()
            model[0].weight[7, :] = planted
        verdict = compare_probe(saved, loaded(4.0, tensor_max_abs=tensor_max_abs([model])), checkpoint="ckpt")
        with torch.no_grad():
            model[0].weight.copy_(kept)
        assert verdict.status == "failed"
        assert verdict.message().startswith(
            f"switch verification refused checkpoint ckpt: model tensor 0.weight {expected}"
        )
    other_names = {"1.weight": saved.tensor_max_abs["1.weight"], "2.weight": 1e20}  # a tied copy's name
    assert compare_probe(saved, loaded(4.0, tensor_max_abs=other_names), checkpoint="ckpt").passed
    older = ProbeRecord.from_dict({k: v for k, v in SAVED.to_dict().items() if k != "tensor_max_abs"})
    assert older.tensor_max_abs is None  # a probe an older cona saved still reads; nothing to compare
