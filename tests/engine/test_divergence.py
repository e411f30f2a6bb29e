"""The divergence checks of each metrics line (the end-to-end run: tests/runner/test_divergence_e2e.py)."""

from __future__ import annotations

import math

import pytest
from tests.helpers.tiny import tiny_config

from cona.engine.divergence import DivergenceWatch
from cona.errors import TrainingDiverged


def test_consecutive_skipped_steps_across_lines_stop_the_run():
    watch = DivergenceWatch(max_skipped_steps=10, loss_factor=10.0)
    watch.check(iteration=4, loss=5.0, steps=4, skipped=0)
    watch.check(iteration=8, loss=5.0, steps=4, skipped=4)  # 4 in a row
    watch.check(iteration=12, loss=math.nan, steps=4, skipped=4)  # 8: a NaN loss of skipped steps only
    with pytest.raises(TrainingDiverged, match="at iteration 16: 12 steps in a row skipped"):
        watch.check(iteration=16, loss=5.0, steps=4, skipped=4)


def test_a_stepped_line_resets_the_count_and_a_loss_spike_stops_the_run():
    watch = DivergenceWatch(max_skipped_steps=5, loss_factor=10.0)
    watch.check(iteration=4, loss=5.0, steps=4, skipped=4)
    watch.check(iteration=8, loss=3.0, steps=4, skipped=2)  # the run stepped: 2 at its end
    watch.check(iteration=12, loss=29.0, steps=4, skipped=0)  # under 10 x 3.0
    with pytest.raises(TrainingDiverged, match=r"mean loss 31 is over 10x the lowest so far \(3;"):
        watch.check(iteration=16, loss=31.0, steps=4, skipped=0)
    with pytest.raises(TrainingDiverged, match="the loss is inf"):
        DivergenceWatch(max_skipped_steps=5, loss_factor=0.0).check(
            iteration=1, loss=math.inf, steps=1, skipped=0
        )


def config(vocab_size: int = 50257):
    return tiny_config(model={"vocab_size": vocab_size}, training={"divergence_loss_factor": 10.0})


def test_a_climb_under_the_stop_factor_is_unfit_to_resume_and_the_lowest_loss_survives_a_resume():
    """8.3 -> 33 is under 10x: the run goes on, but that state never becomes ``latest`` and, resumed, the
    run still compares with 8.3 (it stopped at 85, which a lowest loss restarted at +inf let through)."""
    watch = DivergenceWatch.from_config(config())
    assert watch.unfit_to_resume() is None  # no line yet
    watch.check(iteration=2, loss=8.3, steps=2, skipped=0)
    assert watch.unfit_to_resume() is None
    watch.check(iteration=4, loss=33.0, steps=2, skipped=0)
    assert watch.unfit_to_resume() == "its loss 33 is over 2x the lowest so far (8.3)"
    state = watch.trainer_state()
    assert state == {"lowest_loss": 8.3, "loss": 33.0}
    resumed = DivergenceWatch.from_config(config(), state)
    assert resumed.unfit_to_resume() is not None  # before its first line: the saved state's loss
    with pytest.raises(TrainingDiverged, match=r"mean loss 85 is over 10x the lowest so far \(8.3;"):
        resumed.check(iteration=6, loss=85.0, steps=2, skipped=0)
    assert DivergenceWatch.from_config(config()).trainer_state() == {"lowest_loss": None, "loss": None}


def test_a_loss_back_above_a_uniform_guess_is_unfit_to_resume():
    watch = DivergenceWatch.from_config(config(vocab_size=512))  # ln(512) = 6.238
    watch.check(iteration=2, loss=7.0, steps=2, skipped=0)
    watch.check(iteration=4, loss=6.5, steps=2, skipped=0)
    assert watch.unfit_to_resume() is None  # never below ln(vocab) yet: an early run's loss
    watch.check(iteration=6, loss=4.0, steps=2, skipped=0)
    watch.check(iteration=8, loss=6.3, steps=2, skipped=0)  # under 2x 4.0, above ln(512)
    assert watch.unfit_to_resume().startswith("its loss 6.3 is above ln(vocab) = 6.238")
    watch.check(iteration=10, loss=4.1, steps=2, skipped=0)
    assert watch.unfit_to_resume() is None


def test_a_fresh_model_s_loss_wandering_around_a_uniform_guess_is_fit_to_resume():
    """A freshly initialised model's lines sit near ln(vocab), a few hundredths either side: no climb."""
    watch = DivergenceWatch.from_config(config(vocab_size=4096))  # ln(4096) = 8.318
    watch.check(iteration=2, loss=8.315, steps=2, skipped=0)
    watch.check(iteration=4, loss=8.334, steps=2, skipped=0)
    assert watch.unfit_to_resume() is None
    watch.check(iteration=6, loss=8.6, steps=2, skipped=0)  # 0.285 nats over the lowest: a climb
    assert watch.unfit_to_resume().startswith("its loss 8.6 is above ln(vocab)")
