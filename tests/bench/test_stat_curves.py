"""bench/stat_curves.py: its plan, its reading of a run's metrics, and its CPU smoke run end to end."""

from __future__ import annotations

import json

import pytest

from cona.planner.curves import load_curves


@pytest.fixture(scope="module")
def stat_curves(import_bench):
    return import_bench("stat_curves")


def test_the_gpu_plan_fits_its_budget_and_every_micro_batch_divides_the_evaluation_set(stat_curves):
    setup = stat_curves.SETUPS["bench"]
    rows = stat_curves.plan_rows(setup)
    assert [row["gbs"] for row in rows] == [16, 32, 64, 128, 256, 512]
    assert sum(row["estimated_s"] for row in rows) <= 9 * 60
    for row in rows:
        assert row["gbs"] % row["mbs"] == 0 and setup.eval_samples % row["mbs"] == 0
        assert row["tokens"] >= setup.tokens and row["iterations"] * row["gbs"] * 512 == row["tokens"]


def test_every_run_shares_the_seed_the_lr_rule_and_the_schedule(stat_curves, tmp_path):
    setup = stat_curves.SETUPS["bench"]
    small, large = (stat_curves.conaconfig(setup, tmp_path, tmp_path, gbs)["training"] for gbs in (16, 512))
    shared = ("seed", "base_lr", "lr_scale_strategy", "lr_warmup_tokens", "lr_decay_tokens",
              "eval_every_tokens", "eval_iters", "base_gbs")  # fmt: skip
    assert all(small[key] == large[key] for key in shared)
    assert small["lr_decay_tokens"] > setup.tokens  # the online runs' horizon, not the run's length


def metrics_line(iteration: int, gbs: int, *, eval_loss: float | None = None) -> dict:
    noise, grad_sqr = 40.0, 1.0
    line = {"stage": 1, "iteration": iteration, "consumed_samples": iteration * gbs,
            "consumed_tokens": iteration * gbs * 32, "gbs": gbs, "mbs": 1, "dp": 1, "tp": 1, "pp": 1,
            "loss": 5.0, "lr": 1e-3, "gns_small_sqr": grad_sqr + noise * grad_sqr, "gns_big_sqr":
            grad_sqr + noise * grad_sqr / gbs, "gns_small_batch": 1, "gns_big_batch": gbs}  # fmt: skip
    return line if eval_loss is None else {**line, "eval_loss": eval_loss}


def test_a_curve_is_the_eval_loss_with_the_noise_scale_the_tracker_had_there(stat_curves, tmp_path):
    rows = [metrics_line(i, 4, eval_loss=6.0 - i / 10 if i % 5 == 0 else None) for i in range(1, 31)]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    curve = stat_curves.curve_of(path, 4, base_gbs=2)
    assert curve["tokens"] == [i * 4 * 32 for i in (5, 10, 15, 20, 25, 30)]
    assert curve["eval_loss"] == pytest.approx([5.5, 5.0, 4.5, 4.0, 3.5, 3.0])
    assert curve["noise_scale"][0] is None  # the tracker needs 7 measurements first
    assert curve["noise_scale"][-1] == pytest.approx(40.0)


@pytest.mark.slow
def test_the_smoke_run_writes_a_curves_file_the_planner_reads(stat_curves, tmp_path):
    out = tmp_path / "curves.json"
    code = stat_curves.main(["--smoke", "--gbs", "2", "--tokens", "256", "--out", str(out),
                             "--work-dir", str(tmp_path / "work")])  # fmt: skip
    assert code == 0
    curves = load_curves(out)
    assert curves.gbs == (2,) and not curves.synthetic and curves.recorded["card"] == "cpu"
    assert len(curves.curves[0].tokens) >= 1 and curves.curves[0].tokens[-1] == 256


def test_the_budget_is_shared_by_the_estimates_and_time_left_passes_on(stat_curves):
    rows = [{"estimated_s": 10.0}, {"estimated_s": 30.0}]
    assert stat_curves.run_deadline(rows, now=0.0, deadline=80.0) == 20.0  # a quarter of the budget
    assert stat_curves.run_deadline(rows[1:], now=5.0, deadline=80.0) == 80.0  # the first ended early
    assert stat_curves.run_deadline(rows[1:], now=90.0, deadline=80.0) == 90.0  # spent: stopped at once


def test_curves_of_several_calls_merge_into_one_file_and_a_gbs_twice_is_refused(stat_curves, tmp_path):
    from tests.helpers.synthetic_curves import synthetic_curves

    small, large = tmp_path / "small.json", tmp_path / "large.json"
    for path, sizes in ((small, (16, 32)), (large, (256, 512))):
        path.write_text(json.dumps(synthetic_curves(gbs_list=sizes)))
    out = tmp_path / "all.json"
    assert stat_curves.main(["--merge", str(small), str(large), "--out", str(out)]) == 0
    merged = load_curves(out)
    assert merged.gbs == (16, 32, 256, 512) and merged.synthetic
    with pytest.raises(SystemExit, match="a gbs is in more than one file"):
        stat_curves.main(["--merge", str(small), str(small), "--out", str(out)])
