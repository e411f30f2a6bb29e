"""Which periodic checkpoints a stage keeps, and when it saves (no process group: the collective parts are
covered end to end by tests/runner/test_periodic_checkpoint_e2e.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from cona.engine.checkpoint import periodic as periodic_save
from cona.engine.checkpoint.periodic import PeriodicSaves, prune_periodic


def checkpoint(layout: Path, iteration: int, **trainer_state) -> Path:
    path = layout / f"global_step{iteration}"
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text(json.dumps({"iteration": iteration, **trainer_state}))
    return path


def test_prune_keeps_the_newest_of_the_stage_and_spares_the_loaded_and_the_latest(tmp_path):
    mine = {"stage": 2, "run": "me", "periodic": True}
    for iteration in (2, 4, 6, 8):
        checkpoint(tmp_path, iteration, **mine)
    checkpoint(tmp_path, 3, **{**mine, "stage": 1})  # another stage's
    checkpoint(tmp_path, 5, **{**mine, "run": "other"})  # another run's, in the same folder
    checkpoint(tmp_path, 1, **{**mine, "periodic": False})  # a stage's last save
    (tmp_path / "global_step7_universal").mkdir()
    (tmp_path / "latest").write_text("global_step4\n")

    removed = prune_periodic(tmp_path, stage=2, owner="me", keep=1, spare=tmp_path / "global_step2")

    assert removed == [tmp_path / "global_step6"]
    left = sorted(path.name for path in tmp_path.iterdir())
    kept = [f"global_step{n}" for n in (1, 2, 3, 4, 5)]
    assert left == [*kept, "global_step7_universal", "global_step8", "latest"]
    assert prune_periodic(tmp_path, stage=2, owner="me", keep=3, spare=None) == []


def saves(**settings) -> PeriodicSaves:
    defaults = {"every_iterations": None, "every_seconds": None, "keep": 2, "start": None}
    return PeriodicSaves(**(defaults | settings), layout_dir=Path("."), stage=1, owner="me")


@pytest.mark.parametrize(
    ("settings", "iteration", "by_time", "due"),
    [
        ({"every_iterations": 5}, 10, False, True),
        ({"every_iterations": 5}, 11, False, False),
        ({"every_iterations": 5}, 11, True, True),
        ({}, 10, False, False),
    ],
)
def test_a_save_is_due_every_n_iterations_or_when_rank_0_s_clock_says(settings, iteration, by_time, due):
    assert saves(**settings).due(iteration, by_time=by_time) is due


def test_the_clock_counts_from_the_last_save_started():
    periodic = saves(every_seconds=60.0)
    assert not periodic.due_by_time()
    periodic.started_at = time.monotonic() - 61.0
    assert periodic.due_by_time()
    assert not saves().due_by_time() and not periodic.pending_written()


class FakeClock:
    """``time.monotonic`` of the periodic saves, moved by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_saves_every_minute_are_due_a_minute_after_each_save_started(monkeypatch):
    """A real interval (60 s, steps of 7 s): due at the first step a minute after the stage started, then a
    minute after that save started, never on every step once the first was due."""
    clock = FakeClock()
    monkeypatch.setattr(periodic_save, "time", clock)
    begun: list[float] = []

    def start(progress, *, writer_group):
        begun.append(clock.now)
        return None  # no save in flight to finish (finishing is collective)

    periodic = saves(every_seconds=60.0, start=start, started_at=clock.now)
    periodic.writer_group = object()  # the writer group is made at the first save (collective)
    began = clock.now
    for _ in range(40):
        clock.now += 7.0
        if periodic.due_by_time():
            periodic.begin(progress=None)
    assert [round(at - began) for at in begun] == [63, 126, 189, 252]
