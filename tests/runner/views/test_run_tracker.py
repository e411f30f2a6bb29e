"""CONA's own signals in the trackers: the online decisions' noise scale, efficiency and
predicted against measured throughput, and one event per switch, read back from TensorBoard's event files;
the line that says whether W&B is on."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from tests.helpers.chain_fakes import FAKE_MODEL, FakeEngine, chain_run, seed_shaped_chain, setup_run
from tests.helpers.online_fakes import StreamingEngine, tiny_online_run
from tests.helpers.tiny import tiny_config
from tests.helpers.wandb_offline import read_offline_run

from cona.runner.schedules.chain_schedule import run_chain
from cona.runner.schedules.online import run_online
from cona.runner.schedules.online_search import DECISIONS_NAME
from cona.runner.views.run_tracker import RunTracker, decision_scalars, wandb_notice, wandb_run_id

tensorboard = pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from tensorboard.util import tensor_util  # noqa: E402


def read_events(directory: Path) -> EventAccumulator:
    return EventAccumulator(str(directory), size_guidance={"scalars": 0, "tensors": 0}).Reload()


def event_texts(events: EventAccumulator) -> list[tuple[int, str]]:
    return [
        (event.step, tensor_util.make_ndarray(event.tensor_proto).item().decode())
        for event in events.Tensors("cona/events/text_summary")
    ]


def with_tensorboard(run, directory: Path):
    training = run.config.training.replace(tensorboard_dir=str(directory))
    return dataclasses.replace(run, config=dataclasses.replace(run.config, training=training))


def test_the_wandb_line_says_why_it_is_off():
    training = load_config_from({"wandb_mode": "offline"})
    assert wandb_notice(training, "r") == (
        "W&B is off: training.wandb_project is not set "
        "(training.wandb_mode 'offline' alone does not turn it on)"
    )
    disabled = load_config_from({"wandb_mode": "disabled", "wandb_project": "p"})
    assert (
        wandb_notice(disabled, "r")
        == "W&B is off: training.wandb_mode is 'disabled' (training.wandb_project 'p')"
    )
    on = load_config_from({"wandb_mode": "offline", "wandb_project": "p"})
    line = wandb_notice(on, "r", "r-0123", Path("/runs/r"))
    assert line.startswith("W&B: project p, mode offline, run r (id r-0123)")
    assert line.endswith("files in /runs/r (to sync: wandb sync /runs/r/wandb/offline-run-*)")


def load_config_from(training: dict):
    """The tiny config's training section with ``training``'s keys set."""
    return config_with(training).training


def config_with(training: dict):
    return tiny_config(model=FAKE_MODEL, training=training)


def test_decision_scalars_follow_the_record_and_skip_unknowns():
    record = {
        "iteration": 7,
        "noise_scale": 120.0,
        "noise_scale_ema": None,
        "current": {"efficiency": 0.8, "measured_tokens_per_s": 900.0},
        "candidate": None,
        "current_predicted_tokens_per_s": 1000.0,
        "predicted_over_measured": float("inf"),
    }
    assert decision_scalars(record) == {
        "cona/noise_scale": 120.0,
        "cona/efficiency": 0.8,
        "cona/measured_tokens_per_s": 900.0,
        "cona/predicted_tokens_per_s": 1000.0,
    }


def test_an_online_run_logs_its_decisions_and_each_switch_to_tensorboard(tmp_path):
    board = tmp_path / "tb"
    run = with_tensorboard(tiny_online_run(tmp_path), board)
    lines: list[str] = []
    engine = StreamingEngine()
    state = run_online(run, launcher=engine, out=lines.append)
    assert [launch.spec.strategy.gbs for launch in engine.launches] == [2, 4]  # one switch
    assert sum(line.startswith("W&B is off: training.wandb_project is not set") for line in lines) == 1

    events = read_events(board / run.run_dir.name)
    decisions = [json.loads(line) for line in (run.run_dir / DECISIONS_NAME).read_text().splitlines()]
    known = [d for d in decisions if d["noise_scale"] is not None]
    assert known, "the fake stream measures a noise scale"
    logged = {event.step: event.value for event in events.Scalars("cona/noise_scale")}
    assert logged == pytest.approx({d["iteration"]: d["noise_scale"] for d in known})
    for tag, key in (
        ("cona/measured_tokens_per_s", "measured_tokens_per_s"),
        ("cona/efficiency", "efficiency"),
    ):
        values = {event.step: event.value for event in events.Scalars(tag)}
        expected = {d["iteration"]: d["current"][key] for d in decisions if d["current"][key] is not None}
        assert values == pytest.approx(expected) and values, tag
    predicted = {event.step: event.value for event in events.Scalars("cona/predicted_tokens_per_s")}
    assert predicted == pytest.approx(
        {d["iteration"]: d["current_predicted_tokens_per_s"] for d in decisions}
    )

    switch_at = state.stage(1).last_iteration
    ((step, text),) = event_texts(events)
    new = engine.launches[1].spec.strategy.short()
    assert (
        step == switch_at
        and text.startswith("stage 1 -> 2: switch")
        and f"to {new} at iteration {switch_at}: " in text
    )
    assert [(event.step, event.value) for event in events.Scalars("cona/stage")] == [(switch_at, 2.0)]


def test_a_chain_logs_one_event_per_step_to_the_next_strategy(tmp_path):
    setup_run(tmp_path, seed_shaped_chain(3))
    board = tmp_path / "tb"
    run = with_tensorboard(chain_run(tmp_path, tmp_path / "chain.json"), board)
    lines: list[str] = []
    state = run_chain(run, launcher=FakeEngine(), out=lines.append)
    texts = event_texts(read_events(board / run.run_dir.name))
    starts = [state.stage(number).start_iteration for number in (2, 3)]
    assert [step for step, _ in texts] == starts
    assert [text.split(":")[0] for _, text in texts] == ["stage 1 -> 2", "stage 2 -> 3"] and all(
        "chain step to dp4/tp1/pp1" in text for _, text in texts
    )

    # the rerun of a finished chain logs no switch again (nor does a resume: a stage is planned once)
    run_chain(run, launcher=FakeEngine(), out=lines.append)
    assert len(event_texts(read_events(board / run.run_dir.name))) == 2


def offline_runs(directory: Path) -> list[Path]:
    return sorted((directory / "wandb").glob("offline-run-*"))


def append_metrics(run_dir: Path, *records: dict) -> None:
    with open(run_dir / "metrics.jsonl", "a") as metrics:
        metrics.writelines(json.dumps(record) + "\n" for record in records)


def test_one_wandb_run_per_cona_run_kept_by_its_resumes_and_shared_by_no_other_run(tmp_path):
    """The workers' curves, forwarded from metrics.jsonl, and CONA's signals go to one W&B run whose id is
    the run's own: two runs of one name in two directories get two ids, a resume keeps its run's."""
    pytest.importorskip("wandb")
    config = config_with({"wandb_project": "cona-test", "wandb_mode": "offline"})
    first, second = tmp_path / "a" / "online", tmp_path / "b" / "online"
    for run_dir in (first, second):
        run_dir.mkdir(parents=True)
        append_metrics(run_dir, {"stage": 1, "iteration": 1, "loss": 9.0})  # an earlier attempt's line
        lines: list[str] = []
        with RunTracker.open(config, run_dir, lines.append) as tracker:
            append_metrics(run_dir, {"stage": 1, "iteration": 2, "loss": 7.0, "eval_loss": 6.5})
            tracker.decision({"iteration": 2, "noise_scale": 50.0, "current": {"efficiency": 0.5}})
            tracker.switch(
                stage=2, iteration=2, action="switch", strategy="dp4/tp1/pp1 mbs2 gbs8", reason="w"
            )
        run_id = wandb_run_id(run_dir)
        assert run_id.startswith("online-") and lines == [
            wandb_notice(config.training, "online", run_id, run_dir)
        ]
        (folder,) = offline_runs(run_dir)  # the workers' curves and CONA's signals: one run
        logged_id, rows = read_offline_run(folder)
        assert logged_id == run_id
        values = {key: value for row in rows for key, value in row.items()}
        assert values["train/loss"] == 7.0 and values["eval/loss"] == 6.5  # not the earlier attempt's 9.0
        assert values["cona/noise_scale"] == 50.0 and {row["iteration"] for row in rows} == {2}
    assert wandb_run_id(first) != wandb_run_id(second)

    kept = wandb_run_id(first)
    with RunTracker.open(config, first, lambda line: None):  # a resume
        append_metrics(first, {"stage": 1, "iteration": 3, "loss": 6.0})
    assert wandb_run_id(first) == kept
    assert [read_offline_run(folder)[0] for folder in offline_runs(first)] == [kept, kept]


def test_a_run_that_logged_nothing_leaves_no_wandb_run(tmp_path):
    pytest.importorskip("wandb")
    config = config_with({"wandb_project": "cona-test", "wandb_dir": str(tmp_path / "w")})
    (tmp_path / "run").mkdir()
    with RunTracker.open(config, tmp_path / "run", lambda line: None):
        pass  # a fixed run stopped before its first metrics line: no decision, no switch
    assert not (tmp_path / "w" / "wandb").exists()


def test_a_failing_wandb_stops_with_one_line_and_the_run_goes_on():
    def no_login():
        raise RuntimeError("api_key not configured (no-tty)")

    lines: list[str] = []
    tracker = RunTracker(open_wandb=no_login, out=lines.append)
    for iteration in (1, 2):
        tracker.decision({"iteration": iteration, "noise_scale": 5.0})
    tracker.close()
    assert lines == ["W&B stopped: RuntimeError: api_key not configured (no-tty)"]
