"""The time-to-target benchmark's bookkeeping on synthetic run directories (no training is run)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "time_to_target.py"
SEQ = 8
LAUNCHED = 1000.0


@pytest.fixture(scope="module")
def ttt():
    spec = importlib.util.spec_from_file_location("time_to_target", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def record(*, stage: int, iteration: int, at: float, gbs: int, ppl: float | None = None) -> dict:
    """A metrics line of one-step intervals, each step 0.5 s."""
    line = {"stage": stage, "iteration": iteration, "consumed_tokens": iteration * gbs * SEQ, "gbs": gbs,
            "mbs": gbs, "step_time_s": 0.5, "steps_in_interval": 1, "tokens_per_s": gbs * SEQ / 0.5,
            "time": at}  # fmt: skip
    return line if ppl is None else {**line, "eval_ppl": ppl}


def write_run(run_dir: Path, records: list[dict], decisions: list[dict] = ()) -> Path:
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"torn')
    (run_dir / "decisions.jsonl").write_text("".join(json.dumps(d) + "\n" for d in decisions))
    return run_dir


def summarize(ttt, run_dir: Path, *, kind: str = "online", target: float = 50.0):
    supervised = ttt.Supervised(launched_at=LAUNCHED, ended_at=LAUNCHED + 60, exit_code=0, stop="exited")
    return ttt.summarize_run(name=run_dir.name, kind=kind, run_dir=run_dir, supervised=supervised,
                             target_ppl=target, levels=[target, 2 * target], seq=SEQ)  # fmt: skip


def test_an_online_run_reads_back_time_tokens_startup_and_its_switch_gap(ttt, tmp_path):
    records = [
        record(stage=1, iteration=1, at=1010.5, gbs=4),  # first step began at 1010: start-up 10 s
        record(stage=1, iteration=2, at=1011.0, gbs=4, ppl=120.0),
        record(stage=2, iteration=3, at=1020.5, gbs=8),  # its step began at 1020: a 9 s gap after 1011
        record(stage=2, iteration=4, at=1021.0, gbs=8, ppl=80.0),
        record(stage=2, iteration=5, at=1021.5, gbs=8, ppl=45.0),
        record(stage=2, iteration=6, at=1022.0, gbs=8, ppl=40.0),
    ]
    run_dir = write_run(tmp_path / "online", records, [{"decision": "stay"}, {"decision": "switch"}])
    row = summarize(ttt, run_dir)
    assert row["reached"] and row["time_to_target_s"] == 21.5 and row["tokens_to_target"] == 5 * 8 * SEQ
    assert row["startup_s"] == 10.0 and row["switch_gaps_s"] == [9.0]
    assert row["stages"] == ["gbs4/mbs4", "gbs8/mbs8"] and row["switches"] == 1
    assert row["training_s"] == 2.5 and row["mean_tokens_per_s"] == round((2 * 4 + 3 * 8) * SEQ / 2.5)
    assert row["eval_spacing_s"] == 0.5 and row["final_ppl"] == 40.0 and row["best_ppl"] == 40.0
    assert row["time_to_level_s"] == {"50": 21.5, "100": 21.0}


def test_a_run_that_misses_the_target_has_no_time_and_counts_as_the_worst_fixed(ttt, tmp_path):
    fast = write_run(tmp_path / "fixed-gbs4", [record(stage=1, iteration=1, at=1012.0, gbs=4, ppl=40.0)])
    slow = write_run(tmp_path / "fixed-gbs8", [record(stage=1, iteration=1, at=1030.0, gbs=8, ppl=49.0)])
    never = write_run(tmp_path / "fixed-gbs16", [record(stage=1, iteration=1, at=1005.0, gbs=16, ppl=90.0)])
    online = write_run(tmp_path / "online", [record(stage=1, iteration=1, at=1024.0, gbs=4, ppl=30.0)])
    rows = [summarize(ttt, online)] + [summarize(ttt, d, kind="fixed") for d in (fast, slow, never)]
    assert rows[3]["reached"] is False and rows[3]["time_to_target_s"] is None
    assert rows[3]["final_ppl"] == 90.0 and rows[3]["time_to_level_s"]["100"] == 5.0
    result = ttt.summary(rows)
    assert result["best_fixed"] == "fixed-gbs4" and result["worst_fixed"] == "fixed-gbs16"
    assert result["online_over_best_fixed"] == 2.0 and "online_over_worst_fixed" not in result
    table = ttt.format_table(rows, 50.0).splitlines()
    assert len(table) == 2 + len(rows) and table[-1].split()[:2] == ["fixed-gbs16", ">60"]


def test_an_empty_run_directory_gives_an_empty_row(ttt, tmp_path):
    row = summarize(ttt, write_run(tmp_path / "online", []))
    assert not row["reached"] and row["startup_s"] is None and row["stages"] == []
    assert ttt.format_table([row], 50.0).splitlines()[-1].startswith("online")


def test_evaluations_fall_every_so_many_tokens_on_a_set_every_micro_batch_divides(ttt):
    assert [ttt.eval_interval(131_072, gbs, 512) for gbs in (8, 32, 64, 1024)] == [32, 8, 4, 1]
    preset = ttt.PRESETS["125m"]
    assert ttt.eval_samples(preset, 64) == 64 and ttt.eval_samples(preset, 48) == 96
    (step,) = ttt.one_step_chain(16, 4, 100)["steps"]
    assert step["is_initial"] and step["train_iters"] == 100 and (step["gbs"], step["mbs"]) == (16, 4)


def stop_rule(ttt, tmp_path: Path, kind: str):
    plan = ttt.RunPlan(name=kind, kind=kind, command=[], root=tmp_path, run_dir=tmp_path / "run", cap_s=30.0)
    return ttt.StopRule(plan=plan, target_ppl=50.0, patience=2, cap_s=30.0, launched=LAUNCHED)


def test_the_stop_rule_stops_a_fixed_run_at_the_target_and_leaves_an_online_run_to_stop_itself(ttt, tmp_path):
    fixed, online = stop_rule(ttt, tmp_path / "f", "fixed"), stop_rule(ttt, tmp_path / "o", "online")
    for rule in (fixed, online):
        rule.see(record(stage=1, iteration=1, at=1001.0, gbs=4, ppl=70.0))
        assert rule.reason is None and not (rule.plan.run_dir / "switch_request.json").exists()
        rule.see(record(stage=1, iteration=2, at=1002.0, gbs=4, ppl=49.0))
    request = json.loads((fixed.plan.run_dir / "switch_request.json").read_text())
    assert fixed.reason == "target" and request["action"] == "stop"
    assert online.reason == "stopped itself" and not (online.plan.run_dir / "switch_request.json").exists()


def test_the_stop_rule_stops_a_run_without_progress_or_past_its_cap(ttt, tmp_path):
    stalled = stop_rule(ttt, tmp_path / "s", "fixed")
    for iteration, ppl in enumerate((60.0, 61.0, 62.0), start=1):
        stalled.see(record(stage=1, iteration=iteration, at=1000.0 + iteration, gbs=4, ppl=ppl))
    assert stalled.reason == "no improvement in 2 evals"
    slow = stop_rule(ttt, tmp_path / "c", "online")
    assert not slow.overdue(LAUNCHED + 29) and slow.reason is None
    slow.overdue(LAUNCHED + 31)
    assert slow.reason == "cap 30 s" and (slow.plan.run_dir / "switch_request.json").exists()
    assert slow.overdue(slow.requested_at + ttt.STOP_GRACE_S + 1)
