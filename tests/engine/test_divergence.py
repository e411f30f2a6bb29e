"""The divergence checks of each metrics line (the end-to-end run: tests/runner/test_divergence_e2e.py)."""

from __future__ import annotations

import math

import pytest

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
