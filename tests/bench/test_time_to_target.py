"""The time-to-target benchmark's bookkeeping on synthetic run directories (no training is run)."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

SEQ = 8
LAUNCHED = 1000.0
MODULES = ("ttt.supervise", "ttt.report", "ttt.plan", "time_to_target")


@pytest.fixture(scope="module")
def ttt(import_bench):
    """The benchmark's modules as one namespace (the script imports its package from bench/)."""
    modules = [import_bench(name) for name in MODULES]
    return types.SimpleNamespace(**{k: v for m in modules for k, v in vars(m).items()})


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
    return ttt.summarize_run(name=run_dir.name, kind=kind, seed=1, run_dir=run_dir, supervised=supervised,
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
    assert row["time_to_target_from_first_step_s"] == 11.5
    assert row["time_to_level_from_first_step_s"] == {"50": 11.5, "100": 11.0}


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
    # gbs 16's last line came at 5 s, before gbs 4 reached the target at 12 s: it might have beaten it.
    assert rows[3]["last_line_s"] == 5.0 and result["fixed_stopped_before_best"] == ["fixed-gbs16"]
    trained_on = {**rows[3], "last_line_s": 13.0}  # its last line after gbs 4's 12 s: no longer named
    assert ttt.summary([rows[0], rows[1], trained_on])["fixed_stopped_before_best"] == []
    capped = {**rows[3], "last_line_s": 11.0, "wall_s": 20.0}  # the time it trained to, not its exit
    assert ttt.summary([rows[0], rows[1], capped])["fixed_stopped_before_best"] == ["fixed-gbs16"]
    table = ttt.format_table(rows, 50.0).splitlines()
    # How far it trained (its last line at 5 s), not its exit at 60 s.
    assert len(table) == 2 + len(rows) and table[-1].split()[:3] == ["fixed-gbs16", "1", ">5"]
    assert result["online_stopped_before_best"] == []
    cut_online = {**rows[3], "run": "online-again", "kind": "online"}  # stopped at 5 s, before gbs 4's 12 s
    assert ttt.summary([*rows[:3], cut_online])["online_stopped_before_best"] == ["online-again"]


def test_an_empty_run_directory_gives_an_empty_row(ttt, tmp_path):
    row = summarize(ttt, write_run(tmp_path / "online", []))
    assert not row["reached"] and row["startup_s"] is None and row["stages"] == []
    assert ttt.format_table([row], 50.0).splitlines()[-1].startswith("online")
    alone = ttt.summary([row], ["50", "100"])  # an online run without fixed ones (a call of --runs online)
    assert alone["ladder"]["50"]["best_fixed"] is None and alone["main_level"] is None


def test_evaluations_fall_every_so_many_tokens_on_a_set_every_micro_batch_divides(ttt):
    assert [ttt.eval_interval(131_072, gbs, 512) for gbs in (8, 32, 64, 1024)] == [32, 8, 4, 1]
    preset = ttt.PRESETS["125m", "demo"]
    assert ttt.eval_samples(preset, 64) == 64 and ttt.eval_samples(preset, 48) == 96
    (step,) = ttt.one_step_chain(strategy(ttt, 16, 4, dp=2), 100)["steps"]
    assert (
        step["is_initial"]
        and step["train_iters"] == 100
        and (step["gbs"], step["mbs"], step["dp"]) == (16, 4, 2)
    )


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


def row(name: str, kind: str, *, startup: float, levels: dict) -> dict:
    return {"run": name, "kind": kind, "startup_s": startup, "time_to_level_from_first_step_s": levels}


def test_the_ladder_charges_online_for_its_extra_start_up_and_picks_the_main_level(ttt):
    rows = [
        row("fixed-gbs8", "fixed", startup=20.0, levels={"40": None, "50": 60.0, "80": 10.0}),
        row("fixed-gbs16", "fixed", startup=22.0, levels={"40": None, "50": 45.0, "80": 12.0}),
        row("online", "online", startup=30.0, levels={"40": 50.0, "50": 30.0, "80": 9.0}),
    ]
    ladder = ttt.ladder_summary(rows, ["40", "50", "80"])
    assert ladder["40"]["best_fixed"] is None  # online alone reached it: no ratio to give
    assert ladder["50"]["best_fixed"] == "fixed-gbs16" and ladder["50"]["best_fixed_s"] == 45.0
    # online: 30 s from its first step + 10 s more start-up than the quickest fixed run (20 s)
    assert ladder["50"]["times_from_first_step_s"]["online"] == 40.0
    assert ladder["50"]["over_best_fixed"] == {"online": round(40.0 / 45.0, 3)}
    assert ladder["80"]["over_best_fixed"] == {"online": 1.9} and ladder["80"]["best_fixed"] == "fixed-gbs8"
    assert ttt.main_level(ladder, 40.0) == "50" and ttt.main_level(ladder, 50.0) is None
    assert "online 0.89x" in ttt.format_ladder(ladder) and "no fixed run" in ttt.format_ladder(ladder)


def test_the_ladder_charges_the_runners_extra_start_up_where_every_run_has_it(ttt, tmp_path):
    """Online adds to the start-up what its runner does before the first stage is planned (imports, the
    initial search); the workers' start is the same code in every mode and is charged only in the
    ``_whole_startup`` ratios."""
    rows = [
        row("fixed-gbs16", "fixed", startup=22.0, levels={"50": 45.0}) | {"runner_s": 8.0},
        row("fixed-gbs32", "fixed", startup=20.0, levels={"50": 50.0}) | {"runner_s": 9.0},
        row("online", "online", startup=30.0, levels={"50": 30.0}) | {"runner_s": 9.5},
    ]
    ladder = ttt.ladder_summary(rows, ["50"])
    assert ladder["50"]["times_from_first_step_s"]["online"] == 31.5  # 30 + (9.5 - 8)
    assert ladder["50"]["over_best_fixed"] == {"online": round(31.5 / 45.0, 3)}
    assert ladder["50"]["over_best_fixed_whole_startup"] == {
        "online": round(40.0 / 45.0, 3)
    }  # 30 + (30 - 20)
    assert "(0.89x charged all its extra start-up)" in ttt.format_ladder(ladder)
    # The runner's part comes from runner_state.json's first stage.
    (tmp_path / "runner_state.json").write_text(json.dumps({"stages": [{"planned_at": LAUNCHED + 7.25}]}))
    assert ttt.runner_seconds(tmp_path, LAUNCHED) == 7.25
    assert ttt.runner_seconds(tmp_path / "missing", LAUNCHED) is None


def strategy(ttt, gbs: int, mbs: int, *, dp: int = 1, tp: int = 1, pp: int = 1):
    from cona.strategy import Strategy

    return Strategy(dp=dp, tp=tp, pp=pp, mbs=mbs, gbs=gbs)


def test_the_ramp_chain_switches_in_one_layout_at_the_token_points_with_absolute_iterations(ttt):
    stages = [strategy(ttt, 8, 4, dp=2), strategy(ttt, 16, 4, dp=2), strategy(ttt, 32, 8, dp=2)]
    chain = ttt.ramp_chain(stages, [8 * 512 * 10, 8 * 512 * 30], 8 * 512 * 100, 512)
    steps = chain["steps"]
    assert [(s["gbs"], s["mbs"], s["train_iters"]) for s in steps] == [(8, 4, 10), (16, 4, 20), (32, 8, 38)]
    assert steps[0]["is_initial"] and steps[1]["load_dp"] == 2 and not any(s["convert"] for s in steps)
    assert {(s["dp"], s["tp"], s["pp"]) for s in steps} == {(2, 1, 1)}
    with pytest.raises(SystemExit, match="--ramp-tokens"):
        ttt.ramp_chain(stages, [5000, 4000], 100_000, 512)
    with pytest.raises(SystemExit, match="one layout"):  # a layout change cannot switch in place
        ttt.ramp_chain([stages[0], strategy(ttt, 16, 4, tp=2)], [5000], 100_000, 512)


def report(**settings) -> dict:
    base = {key: 1 for key in ttt_must_match()} | settings
    return {"settings": base, "runs": []}


def ttt_must_match() -> tuple[str, ...]:
    return ("model", "corpus", "data_prefix", "target_ppl", "total_tokens", "warmup_tokens",
            "eval_every_tokens", "initial_gbs", "max_gbs", "levels", "compile", "seq", "gpus")  # fmt: skip


def test_merging_keeps_every_run_once_and_refuses_other_settings(ttt):
    first, second = report(), report()
    first["runs"] = [{"run": "online", "x": 1}, {"run": "fixed-gbs8", "x": 1}]
    second["runs"] = [{"run": "fixed-gbs8", "x": 2}, {"run": "ramp", "x": 2}]
    merged = ttt.merge_reports([("a.json", first), ("b.json", second)])
    assert [(r["run"], r["x"]) for r in merged["runs"]] == [("online", 1), ("fixed-gbs8", 2), ("ramp", 2)]
    assert merged["settings"]["merged_from"] == ["a.json", "b.json"]
    third = report()  # another seed's run of the same name is a row of its own
    third["runs"] = [{"run": "online", "seed": 7, "x": 3}]
    third["headroom"] = {"7": {"headroom": 1.1}}
    merged = ttt.merge_reports([("a.json", first), ("c.json", third)])
    assert [(r["run"], r["x"]) for r in merged["runs"]] == [("online", 1), ("fixed-gbs8", 1), ("online", 3)]
    assert merged["settings"]["seeds"] == [0, 7] and merged["headroom"] == {"7": {"headroom": 1.1}}
    with pytest.raises(ValueError, match="b.json has gpus=2"):  # runs on other device counts do not mix
        ttt.merge_reports([("a.json", first), ("b.json", report(gpus=2))])
    with pytest.raises(ValueError, match="b.json has target_ppl=30"):
        ttt.merge_reports([("a.json", first), ("b.json", report(target_ppl=30))])


def fake_planner(ttt):
    """The planner's choice without the planner: dp over every device at gbs <= 16, else tp over them (a
    layout that changes with the gbs), mbs = gbs / dp; ``layout`` keeps the one given."""

    def best(config, system, gpus, gbs, layout=None):
        dp, tp, pp = layout or ((gpus, 1, 1) if gbs <= 16 else (1, gpus, 1))
        return strategy(ttt, gbs, gbs // dp, dp=dp, tp=tp, pp=pp)

    return best


def fake_corpus(tmp_path: Path) -> list[str]:
    (tmp_path / "c.bin").write_bytes(b"")
    (tmp_path / "gpt2-vocab.json").write_text("{}")
    return ["--data-dir", str(tmp_path), "--data-prefix", "c", "--out", str(tmp_path / "o.json")]


def test_the_flags_give_doubling_fixed_runs_a_run_selection_and_one_line_errors(ttt, tmp_path):
    args, preset = ttt.parse_args(["--model", "125m", *fake_corpus(tmp_path)])
    assert args.fixed_gbs == [8, 16, 32, 64] and args.compile and preset.model["seq"] == 512
    assert args.runs == ["online", "fixed-gbs8", "fixed-gbs64", "fixed-gbs16", "fixed-gbs32", "ramp"]
    args, _ = ttt.parse_args(["--runs", "ramp,fixed-gbs16", "--no-compile", *fake_corpus(tmp_path)])
    assert args.runs == ["ramp", "fixed-gbs16"] and not args.compile
    with pytest.raises(SystemExit, match="--stop-behind: 0.8 would stop a fixed run"):
        ttt.parse_args(["--stop-behind", "0.8", *fake_corpus(tmp_path)])
    with pytest.raises(SystemExit, match="--runs: unknown fixed-gbs12"):
        ttt.parse_args(["--runs", "fixed-gbs12", *fake_corpus(tmp_path)])
    with pytest.raises(SystemExit, match="--data-dir/--data-prefix"):
        ttt.parse_args(["--data-dir", str(tmp_path / "none"), "--out", "x.json"])
    args, _ = ttt.parse_args(["--smoke", *fake_corpus(tmp_path)])
    assert args.runs == ["online", "fixed-gbs2", "ramp"] and not args.compile
    assert args.seeds == [ttt.SEEDS[0]] and args.gpus == 1 and args.static_gbs == 2
    args, _ = ttt.parse_args(
        ["--model", "125m", "--static-gbs", "24", "--seeds", "7,5", *fake_corpus(tmp_path)]
    )
    assert args.fixed_gbs == [8, 16, 24, 32, 64] and args.seeds == [5, 7]  # the static planner's gbs joins
    assert ttt.parse_args(["--model", "125m", *fake_corpus(tmp_path)])[0].seeds == list(ttt.SEEDS)
    with pytest.raises(SystemExit, match="--ramp-tokens: 3 doublings from --initial-gbs 8 reach gbs 64"):
        ttt.parse_args(
            ["--model", "125m", "--ramp-tokens", "1,2,3", "--max-gbs", "32", *fake_corpus(tmp_path)]
        )
    with pytest.raises(SystemExit, match="--seeds"):
        ttt.parse_args(["--seeds", "one", *fake_corpus(tmp_path)])


def test_on_several_devices_each_fixed_run_takes_its_gbs_best_layout_and_the_ramp_keeps_one_in_place(
    ttt, tmp_path, monkeypatch
):
    monkeypatch.setattr(sys.modules["ttt.plan"], "best_strategy", fake_planner(ttt))
    args, preset = ttt.parse_args(["--model", "125m", "--gpus", "2", *fake_corpus(tmp_path)])
    small = ttt.plan_run("fixed-gbs8", preset, args, tmp_path / "s1", seed=3)
    large = ttt.plan_run("fixed-gbs64", preset, args, tmp_path / "s1", seed=3)
    ramp = ttt.plan_run("ramp", preset, args, tmp_path / "s1", seed=3)
    online = ttt.plan_run("online", preset, args, tmp_path / "s1", seed=3)
    for plan in (small, large, ramp, online):
        assert plan.command[plan.command.index("--gpus") + 1] == "2"
        assert json.loads((plan.root / ".conaconfig").read_text())["training"]["seed"] == 3
    (step,) = json.loads((small.root / "chain.json").read_text())["steps"]
    assert (step["dp"], step["tp"], step["mbs"]) == (2, 1, 4)
    (step,) = json.loads((large.root / "chain.json").read_text())["steps"]
    assert (step["dp"], step["tp"], step["mbs"]) == (1, 2, 64)
    steps = json.loads((ramp.root / "chain.json").read_text())["steps"]
    assert [(s["gbs"], s["dp"], s["tp"]) for s in steps] == [(8, 2, 1), (16, 2, 1), (32, 2, 1)]
    assert "--switch-in-place" in ramp.command and "--switch-in-place" not in large.command


def test_the_mean_over_seeds_gives_tokens_and_time_apart_where_every_seed_reached(ttt):
    def seeded(name: str, kind: str, seed: int, level_s: float | None, tokens: int | None) -> dict:
        base = row(name, kind, startup=20.0, levels={"50": level_s})
        return {**base, "seed": seed, "tokens_to_level": {"50": tokens}, "reached": level_s is not None,
                "time_to_target_s": level_s}  # fmt: skip

    rows = [
        seeded("fixed-gbs8", "fixed", 1, 60.0, 1000), seeded("fixed-gbs8", "fixed", 2, 70.0, 1200),
        seeded("online", "online", 1, 50.0, 900), seeded("online", "online", 2, 60.0, 1100),
        seeded("ramp", "ramp", 1, 55.0, 800), seeded("ramp", "ramp", 2, None, None),
    ]  # fmt: skip
    result = ttt.seeds_summary(rows, ["50"], min_training_s=0.0)
    assert result["seeds"] == [1, 2] and set(result["by_seed"]) == {1, 2}
    level = result["ladder"]["50"]
    assert level["runs"]["online"] == {"seeds": 2, "reached": 2, "mean_time_s": 55.0, "mean_tokens": 1000}
    assert level["runs"]["ramp"]["mean_time_s"] is None and level["runs"]["ramp"]["reached"] == 1
    assert level["best_fixed"] == "fixed-gbs8" and level["over_best_fixed"] == {
        "fixed-gbs8": 1.0,
        "online": 0.846,
    }
    assert result["main_level"] == "50"
    text = ttt.format_seeds_ladder(result["ladder"], result["seeds"])
    assert "online 55.0 s 1,000 tokens 0.85x" in text and "ramp 1/2 reached" in text


def test_a_stop_asked_for_at_a_stage_boundary_is_asked_again_of_the_next_stage(ttt, tmp_path):
    ramp = stop_rule(ttt, tmp_path / "r", "ramp")
    ramp.see(record(stage=1, iteration=2, at=1002.0, gbs=4, ppl=49.0))
    request = ramp.plan.run_dir / "switch_request.json"
    assert ramp.reason == "target" and request.exists()
    request.unlink()  # what the chain runner does when it launches stage 2
    ramp.see(record(stage=1, iteration=2, at=1002.5, gbs=4))
    assert not request.exists()
    ramp.see(record(stage=2, iteration=3, at=1010.0, gbs=8))
    assert json.loads(request.read_text())["action"] == "stop"


def test_a_fixed_run_is_capped_behind_the_best_fixed_run_and_online_is_not(ttt, tmp_path):
    def plan(kind: str, cap_s: float):
        return ttt.RunPlan(name=kind, kind=kind, command=[], root=tmp_path, run_dir=tmp_path, cap_s=cap_s)

    fixed, online, ramp = plan("fixed", 160.0), plan("online", 240.0), plan("ramp", 200.0)
    shares = {"left_s": 1000.0, "best_fixed_s": None, "stop_behind": 1.3}
    assert ttt.run_cap(fixed, [fixed, online], **shares) == 160.0  # nothing reached yet: its own cap
    shares["best_fixed_s"] = 100.0
    assert ttt.run_cap(fixed, [fixed], **shares) == pytest.approx(130.0)
    assert ttt.run_cap(ramp, [ramp], **shares) == pytest.approx(130.0)
    assert ttt.run_cap(online, [online], **shares) == 240.0
    shares["stop_behind"] = 0.0
    assert ttt.run_cap(fixed, [fixed], **shares) == 160.0
    # The budget left is shared in proportion to the caps still to come, less a save's time.
    assert ttt.run_cap(fixed, [fixed, online], left_s=400.0, best_fixed_s=None, stop_behind=1.3) == (
        pytest.approx(400.0 * 160 / 400 - ttt.END_MARGIN_S)
    )


def test_a_gpu_comparison_warms_up_with_a_short_eager_run_that_is_not_reported(ttt, tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules["ttt.plan"], "best_strategy", fake_planner(ttt))
    args, preset = ttt.parse_args(["--model", "125m", *fake_corpus(tmp_path)])
    assert args.warmup and args.compile
    assert not ttt.parse_args(["--smoke", *fake_corpus(tmp_path)])[0].warmup
    assert not ttt.parse_args(["--no-warmup", *fake_corpus(tmp_path)])[0].warmup
    plan = ttt.plan_warmup(preset, args, tmp_path / "work")
    config = json.loads((plan.root / ".conaconfig").read_text())
    (step,) = json.loads((plan.root / "chain.json").read_text())["steps"]
    assert plan.kind == "warmup" and not config["training"]["compile"]
    assert (step["gbs"], step["train_iters"]) == (args.initial_gbs, ttt.WARMUP_ITERATIONS)


def test_an_online_variant_runs_online_with_config_keys_set_and_bad_ones_are_refused_before_any_run(
    ttt, tmp_path
):
    corpus = fake_corpus(tmp_path)
    (tmp_path / "gpt2-vocab.json").write_text(json.dumps({"a": 0, "b": 1}))  # a config that loads
    (tmp_path / "gpt2-merges.txt").write_text("#version: 0.2\n")
    variant = ["--online-variant", "windowed", "training.fallback_ema_alpha=1"]
    args, preset = ttt.parse_args(["--model", "125m", *variant, *corpus])
    assert args.runs[:2] == ["online", "online-windowed"]
    assert args.online_variants == {"windowed": ["training.fallback_ema_alpha=1"]}
    plain = ttt.plan_run("online", preset, args, tmp_path / "work", seed=1)
    windowed = ttt.plan_run("online-windowed", preset, args, tmp_path / "work", seed=1)
    assert windowed.kind == "online" and "--set" not in plain.command
    at = windowed.command.index("--set")
    assert windowed.command[at:] == ["--set", "training.fallback_ema_alpha=1"]
    assert len(windowed.command[:at]) == len(plain.command)  # otherwise the same flags
    # A key the config does not have is refused when the run is planned, naming it.
    typo = ["--online-variant", "typo", "training.fallback_ema=1"]
    args, preset = ttt.parse_args(["--model", "125m", *typo, *corpus])
    with pytest.raises(SystemExit, match="fallback_ema"):
        ttt.plan_run("online-typo", preset, args, tmp_path / "work2", seed=1)
    for bad in (["x", "fallback_ema_alpha=1"], ["x"], ["no-dash", "training.seed=1"]):
        with pytest.raises(SystemExit, match="--online-variant"):
            ttt.parse_args(["--online-variant", *bad, *corpus])


def test_a_fixed_variant_runs_its_gbs_with_config_keys_set_and_bad_ones_are_refused_before_any_run(
    ttt, tmp_path, monkeypatch
):
    monkeypatch.setattr(sys.modules["ttt.plan"], "best_strategy", fake_planner(ttt))
    corpus = fake_corpus(tmp_path)
    (tmp_path / "gpt2-vocab.json").write_text(json.dumps({"a": 0, "b": 1}))  # a config that loads
    (tmp_path / "gpt2-merges.txt").write_text("#version: 0.2\n")
    variant = ["--fixed-variant", "lr32", "16", "training.base_lr=0.0008"]
    args, preset = ttt.parse_args(["--model", "125m", *variant, *corpus])
    assert "fixed-gbs16-lr32" in args.runs
    assert args.fixed_variants == {"fixed-gbs16-lr32": (16, ["training.base_lr=0.0008"])}
    plain = ttt.plan_run("fixed-gbs16", preset, args, tmp_path / "work", seed=1)
    varied = ttt.plan_run("fixed-gbs16-lr32", preset, args, tmp_path / "work", seed=1)
    assert varied.kind == plain.kind == "fixed" and "--set" not in plain.command
    at = varied.command.index("--set")
    assert varied.command[at:] == ["--set", "training.base_lr=0.0008"]
    # The same gbs, mbs, iterations and evaluation spacing as the plain fixed run at 16.
    chain = json.loads((varied.root / "chain.json").read_text())
    assert chain == json.loads((plain.root / "chain.json").read_text())
    varied_training, plain_training = (
        json.loads((run.root / ".conaconfig").read_text())["training"] for run in (varied, plain)
    )
    for key in ("eval_interval", "eval_iters", "base_lr"):  # base_lr too: --set applies it at the start
        assert varied_training[key] == plain_training[key], key
    typo = ["--fixed-variant", "typo", "16", "training.base_learning_rate=1"]
    args, preset = ttt.parse_args(["--model", "125m", *typo, *corpus])
    with pytest.raises(SystemExit, match="base_learning_rate"):
        ttt.plan_run("fixed-gbs16-typo", preset, args, tmp_path / "work2", seed=1)
    for bad in (["x", "16"], ["x", "sixteen", "training.seed=1"], ["no-dash", "16", "training.seed=1"]):
        with pytest.raises(SystemExit, match="--fixed-variant"):
            ttt.parse_args(["--fixed-variant", *bad, *corpus])
    twice = ["--fixed-variant", "a", "16", "training.seed=1"] * 2
    with pytest.raises(SystemExit, match="given twice"):
        ttt.parse_args([*twice, *corpus])


def test_the_summary_gives_every_online_run_over_the_best_fixed_one(ttt):
    def reached(name: str, kind: str, seconds: float, level_s: float) -> dict:
        base = row(name, kind, startup=20.0, levels={"50": level_s})
        return {**base, "reached": True, "time_to_target_s": seconds}

    rows = [
        reached("fixed-gbs8", "fixed", 80.0, 60.0),
        reached("online-windowed", "online", 60.0, 40.0),
        reached("online", "online", 70.0, 50.0),
    ]
    result = ttt.summary(rows, ["50"], min_training_s=0.0)
    assert result["online_over_best_fixed"] == 0.875  # the run named online, not the first online one
    assert result["over_best_fixed_by_run"] == {"online-windowed": 0.75, "online": 0.875}
    assert result["ladder"]["50"]["over_best_fixed"] == {"online-windowed": 0.667, "online": 0.833}


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_cpu_smoke_comparison_on_two_processes_runs_fixed_and_the_in_place_ramp_in_one_layout(
    ttt, tmp_path
):
    demo = Path(__file__).resolve().parents[2] / "data" / "demo"
    if not (demo / "wiki_text_document.bin").is_file():
        pytest.skip("the demo data (scripts/install.sh) is not there")
    out = tmp_path / "ttt.json"
    argv = [
        "--smoke",
        "--gpus",
        "2",
        "--runs",
        "fixed-gbs2,ramp",
        "--stop-behind",
        "0",
        "--work-dir",
        str(tmp_path / "w"),
    ]
    assert ttt.main([*argv, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = {row["run"]: row for row in report["runs"]}
    assert set(rows) == {"fixed-gbs2", "ramp"} and all(row["seed"] == ttt.SEEDS[0] for row in rows.values())
    assert all(row["reached"] for row in rows.values())
    ramp = rows["ramp"]
    assert len(ramp["stages"]) >= 2 and ramp["switches"] == len(ramp["stages"]) - 1
    assert len({label.split()[0] for label in ramp["stages"]}) == 1  # one layout: every switch in place
    assert "--switch-in-place" in report["settings"]["commands"][f"ramp seed {ttt.SEEDS[0]}"]
    run_dir = tmp_path / "w" / f"seed{ttt.SEEDS[0]}" / "ramp" / "logs" / "ramp"
    stages = json.loads((run_dir / "runner_state.json").read_text())["stages"]
    assert all(stage["load_path"] is None for stage in stages[1:])  # continued in memory, nothing loaded
    assert report["summary"]["ladder"]["48000"]["runs"]["ramp"]["mean_tokens"] == ramp["tokens_to_target"]
