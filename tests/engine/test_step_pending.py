"""The step without host syncs: device-side outputs, GNS measured on chosen steps, the trainer's interval
sums, and a smoke run of the engine-vs-reference bench on the CPU."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.helpers.tiny import TINY_MODEL, tiny_engine

from cona.config import parse_config
from cona.engine.spec import StageSpec
from cona.engine.train_model import PendingStepOutput
from cona.engine.trainer import GNS_FIRST_STEPS, IntervalSums, Progress, gns_due, regrouped_eval_batches
from cona.planner.efficiency import MIN_SAMPLES
from cona.runner.run_dir import resolve_log_root
from cona.strategy import Strategy

REPO = Path(__file__).resolve().parents[2]


def batches(rows: int, mbs: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    tokens = torch.randint(0, 64, (rows, 9), generator=torch.Generator().manual_seed(seed))
    return list(zip(tokens[:, :-1].split(mbs), tokens[:, 1:].split(mbs), strict=True))


def test_pending_step_keeps_its_outputs_on_the_device_and_is_deterministic(one_process_group) -> None:
    pending_engine, float_engine = tiny_engine(gbs=4, mbs=2), tiny_engine(gbs=4, mbs=2)
    data = batches(4, 2, seed=0)
    pending = pending_engine.train_step_pending(data)
    assert isinstance(pending.loss, torch.Tensor) and pending.loss.dim() == 0
    assert pending.result() == float_engine.train_step_pending(data).result()
    norm = pending_engine.clip_grad_norm_pending(0.05)
    assert isinstance(norm, torch.Tensor)
    assert norm.item() == float_engine.clip_grad_norm_pending(0.05).item()
    pairs = zip(
        pending_engine.model_parts[0].parameters(), float_engine.model_parts[0].parameters(), strict=True
    )
    for a, b in pairs:
        assert torch.equal(a.grad, b.grad)


def test_unmeasured_steps_restart_the_difference_estimator(one_process_group) -> None:
    engine = tiny_engine(gbs=1, mbs=1)  # one sample on one rank: the only case without halves
    first, second, third = (batches(1, 1, seed=s) for s in (1, 2, 3))
    assert math.isnan(engine.train_step_pending(first).result().gns_big_sqr)  # nothing to pair with yet
    skipped = engine.train_step_pending(second, measure_gns=False).result()
    assert math.isnan(skipped.gns_small_sqr) and math.isnan(skipped.gns_big_sqr)
    assert math.isfinite(skipped.loss)
    again = engine.train_step_pending(
        third
    ).result()  # the first gradient is forgotten: no pair across a skipped step
    assert math.isnan(again.gns_small_sqr)
    assert math.isfinite(engine.train_step_pending(first).result().gns_small_sqr)


def test_unmeasured_micro_batch_steps_report_nan(one_process_group) -> None:
    engine = tiny_engine(gbs=4, mbs=2)
    data = batches(4, 2, seed=4)
    measured = engine.train_step_pending(data).result()
    off = engine.train_step_pending(data, measure_gns=False).result()
    assert math.isnan(off.gns_small_sqr) and off.loss == measured.loss
    assert engine.train_step_pending(data).result().gns_small_sqr == pytest.approx(
        measured.gns_small_sqr, rel=1e-6
    )


def pending(loss: float, small: float, big: float) -> PendingStepOutput:
    values = (torch.tensor(v) for v in (loss, small, big))
    loss_t, small_t, big_t = values
    return PendingStepOutput(
        loss=loss_t, gns_small_sqr=small_t, gns_big_sqr=big_t, gns_small_batch=2, gns_big_batch=4
    )


def test_interval_means_skip_non_finite_gns_inputs() -> None:
    interval = IntervalSums()
    interval.add(pending(4.0, math.nan, math.nan), torch.tensor(1.0), torch.tensor(True))
    interval.add(pending(2.0, 3.0, 1.0), torch.tensor(3.0), torch.tensor(True))
    interval.add(pending(3.0, 5.0, math.inf), torch.tensor(2.0), torch.tensor(False))
    interval.add(pending(3.0, 7.0, 2.0), torch.tensor(2.0), torch.tensor(True))
    means = interval.means()
    assert means == {
        "loss": 3.0,
        "grad_norm": 2.0,
        "gns_small_sqr": 5.0,
        "gns_big_sqr": 1.5,
        "gns_steps": [[3.0, 1.0], [7.0, 2.0]],
        "skipped_steps": 1,
    }
    empty = IntervalSums()
    empty.add(pending(1.0, math.nan, math.nan), torch.tensor(1.0), torch.tensor(True))
    assert math.isnan(empty.means()["gns_small_sqr"])


def stage_spec(tmp_path: Path, log_interval: int, **stop) -> StageSpec:
    raw = {
        "model": TINY_MODEL,
        "training": {"device": "cpu", "log_interval": log_interval, "eval_interval": 1000},
    }
    config = resolve_log_root(parse_config(raw, source=tmp_path / ".conaconfig"))
    return StageSpec(
        run_dir=tmp_path / "run",
        config=config,
        strategy=Strategy(dp=1, tp=1, pp=1, mbs=2, gbs=2),
        stage=1,
        workdir=tmp_path / "work",
        planned_tokens=10_000,
        **stop,
    )


def measured_iterations(spec: StageSpec, steps: int) -> list[int]:
    """The iteration numbers (counted after the step) whose steps measure the GNS inputs."""
    tokens = spec.strategy.gbs * spec.config.model.seq
    return [
        done + 1
        for done in range(steps)
        if gns_due(spec, Progress(iteration=done, consumed_samples=2 * done, consumed_tokens=tokens * done))
    ]


def test_gns_is_measured_on_the_first_steps_and_the_steps_before_each_line(tmp_path: Path) -> None:
    first = list(range(2, GNS_FIRST_STEPS + 2))  # the first step stays whole: it warms the whole shape
    assert GNS_FIRST_STEPS == MIN_SAMPLES  # the tracker's first estimate comes from the first steps
    short = stage_spec(tmp_path, log_interval=8, target_iteration=24)
    assert measured_iterations(short, 24) == [2, 3, 4, 5, 6, 7, 8, 15, 16, 23, 24]  # the first line's
    spec = stage_spec(tmp_path, log_interval=20, target_iteration=45)
    assert measured_iterations(spec, 45) == [*first, 19, 20, 39, 40, 44, 45]
    by_tokens = stage_spec(tmp_path, log_interval=20, max_tokens=32 * 25)
    assert measured_iterations(by_tokens, 25) == [*first, 19, 20, 24, 25]
    long_interval = stage_spec(tmp_path, log_interval=50, target_iteration=1000)
    assert measured_iterations(long_interval, 100) == [*first, 46, 47, 48, 49, 50, 96, 97, 98, 99, 100]


def run_bench(*extra: str) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(REPO / "bench" / "engine_vs_ref.py"), "--device", "cpu", "--sizes", "tiny"]
    command += [
        "--mbs",
        "2",
        "--seq",
        "16",
        "--warmup",
        "0",
        "--steps",
        "2",
        "--repeats",
        "1",
        "--no-compile",
    ]
    done = subprocess.run(command + list(extra), env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [line for line in done.stdout.splitlines() if line.startswith("{")]


def test_bench_smoke_run_on_cpu() -> None:
    (row,) = [json.loads(line) for line in run_bench()]
    assert (row["size"], row["mbs"], row["seq"]) == ("tiny", 2, 16)
    for side in ("ref", "ours"):  # a step of 2 x 16 tokens of the tiny model: milliseconds, not minutes
        assert 0 < row[f"{side}_step_ms"] < 10_000, row
        assert row[f"{side}_tok_s"] == round(2 * 16 / (row[f"{side}_step_ms"] / 1e3))
        assert row[f"{side}_first_step_s"] > 0
    assert row["ratio"] == pytest.approx(row["ref_step_ms"] / row["ours_step_ms"], abs=1e-3)


@pytest.mark.slow
def test_bench_gns_overhead_mode_on_cpu() -> None:
    (row,) = [json.loads(line) for line in run_bench("--gns-overhead")]
    assert row["gns_off_step_ms"] > 0 and row["gns_every_step_ms"] > 0 and row["gns_trainer_step_ms"] > 0
    assert row["overhead_every_step"] == pytest.approx(
        row["gns_every_step_ms"] / row["gns_off_step_ms"] - 1, abs=1e-3
    )


def test_an_in_place_switch_regroups_the_evaluation_samples_at_the_new_mbs() -> None:
    rows = torch.arange(24).reshape(8, 3)
    batches = list(zip(rows.split(2), (rows + 100).split(2), strict=True))
    regrouped = regrouped_eval_batches(batches, 4)
    assert [inputs.shape[0] for inputs, _ in regrouped] == [4, 4]
    assert torch.equal(torch.cat([inputs for inputs, _ in regrouped]), rows)
    assert torch.equal(torch.cat([targets for _, targets in regrouped]), rows + 100)
    assert regrouped_eval_batches(batches, 3) is batches  # 8 rows do not divide into 3: kept as cut
