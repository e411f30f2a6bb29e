import math

import numpy as np
import pytest

from cona.errors import PlanError
from cona.planner.efficiency import (
    MIN_SAMPLES,
    NoiseScaleEstimate,
    NoiseScaleTracker,
    adascale_gain,
    at_newest,
    has_trend,
    median_of_means,
    progress_per_second,
    statistical_efficiency,
    two_batch_estimate,
)


def test_two_batch_estimate_inverts_the_expected_norms():
    grad_sqr, trace_sigma, small, big = 3.0, 120.0, 4, 32
    small_sqr = grad_sqr + trace_sigma / small
    big_sqr = grad_sqr + trace_sigma / big
    g, s = two_batch_estimate(small_sqr, big_sqr, small, big)
    assert float(g) == pytest.approx(grad_sqr)
    assert float(s) == pytest.approx(trace_sigma)


def test_two_batch_estimate_is_vectorised_and_checks_batches():
    g, s = two_batch_estimate(np.array([2.0, 5.0]), np.array([1.0, 1.0]), np.array([1, 1]), np.array([2, 5]))
    assert g.tolist() == pytest.approx([0.0, 0.0])
    assert s.tolist() == pytest.approx([2.0, 5.0])
    with pytest.raises(PlanError, match="gns_small_batch"):
        two_batch_estimate(1.0, 1.0, 8, 8)


def regression_gradient_norms(rng, steps, small, big, dim, error_sqr, label_noise):
    """Squared norms of per-chunk and whole-batch mean gradients of 0.5 (x.w - y)^2 with x ~ N(0, I).

    With e = w - w*, the per-sample gradient g = x (x.e - eps) has mean G = e and covariance
    e e^T + (|e|^2 + sigma^2) I (Isserlis), so tr(Sigma) = |e|^2 + dim (|e|^2 + sigma^2).
    """
    error = np.zeros(dim)
    error[0] = np.sqrt(error_sqr)
    x = rng.standard_normal((steps, big, dim))
    eps = rng.normal(0.0, np.sqrt(label_noise), size=(steps, big))
    per_sample = x * (x @ error - eps)[..., None]
    chunks = per_sample.reshape(steps, big // small, small, dim).mean(axis=2)
    small_sqr = (chunks**2).sum(axis=-1).mean(axis=1)
    big_sqr = (per_sample.mean(axis=1) ** 2).sum(axis=-1)
    return small_sqr, big_sqr


def test_tracker_recovers_a_planted_noise_scale():
    dim, error_sqr, label_noise = 10, 1.0, 1.0
    true_phi = (error_sqr + dim * (error_sqr + label_noise)) / error_sqr  # 21 samples
    rng = np.random.default_rng(0)
    small_sqr, big_sqr = regression_gradient_norms(rng, 3000, 4, 64, dim, error_sqr, label_noise)
    tracker = NoiseScaleTracker(base_batch=64)
    for s, b in zip(small_sqr, big_sqr, strict=True):
        tracker = tracker.update(small_sqr=float(s), big_sqr=float(b), small_batch=4, big_batch=64)
    assert tracker.noise_scale() == pytest.approx(true_phi, rel=0.10)
    estimate = tracker.estimate()
    assert estimate.grad_sqr == pytest.approx(error_sqr, rel=0.10)
    assert estimate.trace_sigma == pytest.approx(true_phi * error_sqr, rel=0.10)


def test_one_measurement_averages_to_itself():
    tracker = NoiseScaleTracker(base_batch=16, min_samples=1).update(
        small_sqr=3.0 + 40.0 / 4, big_sqr=3.0 + 40.0 / 32, small_batch=4, big_batch=32
    )
    estimate = tracker.estimate()
    assert estimate.grad_sqr == pytest.approx(3.0)
    assert estimate.trace_sigma == pytest.approx(40.0)
    assert tracker.measurements[0][0] == 32  # without a position: one big batch after the start


def planted_measurements(rng, steps, small=4, big=64):
    """Per-step two-batch measurements of the regression of :func:`regression_gradient_norms`; phi = 21."""
    return regression_gradient_norms(rng, steps, small, big, dim=10, error_sqr=1.0, label_noise=1.0)


def test_a_first_measurement_100x_the_others_is_outvoted_within_50_steps():
    """A warm-up step with gradient norms ~100x the later ones (a |G|^2 estimate far below 0) holds a
    bias-corrected EMA negative for millions of tokens. Robust averaging must know the noise scale within
    50 steps."""
    small_sqr, big_sqr = planted_measurements(np.random.default_rng(3), 50)
    small_sqr[0] *= 100.0  # its |G|^2 estimate: far below 0
    tracker = NoiseScaleTracker(base_batch=64)
    known_at = None
    for step, (s, b) in enumerate(zip(small_sqr, big_sqr, strict=True), start=1):
        tracker = tracker.update(small_sqr=float(s), big_sqr=float(b), small_batch=4, big_batch=64)
        if known_at is None and tracker.noise_scale() is not None:
            known_at = step
    assert two_batch_estimate(small_sqr[0], big_sqr[0], 4, 64)[0] < -20  # the true |G|^2 is 1
    assert known_at is not None and known_at <= 50
    assert tracker.noise_scale() == pytest.approx(21.0, rel=0.25)


def test_a_line_listing_its_measured_steps_gives_one_measurement_per_step():
    """The run's first steps are all measured (``gns_steps``): at a log interval of 8 the tracker has its
    seven measurements, and a noise scale, at the first line, and the line's means alone would be one."""
    small_sqr, big_sqr = planted_measurements(np.random.default_rng(5), 11)
    pairs = [[float(s), float(b)] for s, b in zip(small_sqr, big_sqr, strict=True)]
    base = {"gns_small_batch": 4, "gns_big_batch": 64, "lr": 1e-3}
    first = {
        **base,
        "consumed_samples": 512,
        "gns_small_sqr": 0.0,
        "gns_big_sqr": 0.0,
        "gns_steps": pairs[:7],
    }
    six = NoiseScaleTracker(base_batch=64).update_from_metrics({**first, "gns_steps": pairs[:6]})
    assert six.samples == 6 and six.noise_scale() is None
    second = {**first, "consumed_samples": 1024, "lr": 2e-3, "gns_steps": pairs[7:]}  # still warming up
    tracker = NoiseScaleTracker(base_batch=64).update_from_metrics(first)
    assert tracker.samples == MIN_SAMPLES == 7 and tracker.noise_scale() is not None
    tracker = tracker.update_from_metrics(second)
    assert tracker.samples == 11
    steps = NoiseScaleTracker(base_batch=64)
    for index, (s, b) in enumerate(pairs):  # at the lines' positions: the window is in samples
        position = 512 if index < 7 else 1024
        steps = steps.update(small_sqr=s, big_sqr=b, small_batch=4, big_batch=64, consumed_samples=position)
    assert tracker.noise_scale() == pytest.approx(steps.noise_scale())
    # One LR per line: steps of one line (equal LRs) do not end the warm-up, the next line's lower LR does.
    assert tracker.warmup_end is None
    cooled = tracker.update_from_metrics({**second, "consumed_samples": 1536, "lr": 1e-3})
    assert cooled.warmup_end == 1536
    means_only = {key: value for key, value in first.items() if key != "gns_steps"}
    assert NoiseScaleTracker(base_batch=64).update_from_metrics(means_only).samples == 1


def test_measurements_leave_the_window_but_at_least_min_samples_stay():
    tracker = NoiseScaleTracker(base_batch=8, min_samples=3, window=100.0)
    for position in (0, 10, 20, 30):  # |G|^2 = 100: a regime the run has left
        tracker = tracker.update(
            small_sqr=100.0, big_sqr=100.0, small_batch=2, big_batch=8, consumed_samples=position
        )
    for position in (150, 160, 170):  # |G|^2 = 1, tr(Sigma) = 3
        tracker = tracker.update(
            small_sqr=2.5, big_sqr=1.375, small_batch=2, big_batch=8, consumed_samples=position
        )
    assert [m[0] for m in tracker.measurements] == [150, 160, 170]
    assert tracker.noise_scale() == pytest.approx(3.0) and tracker.samples == 7
    far = tracker.update(small_sqr=2.5, big_sqr=1.375, small_batch=2, big_batch=8, consumed_samples=10_000)
    assert len(far.measurements) == 3  # a long log interval keeps min_samples measurements
    assert NoiseScaleTracker(base_batch=8).window is None  # default: see WINDOW_FRACTION


def test_the_default_window_is_three_quarters_of_the_run_early_and_500_base_batches_later():
    tracker = NoiseScaleTracker(base_batch=2, min_samples=3)  # 500 batches of 2: 1,000 samples
    measurement = exact_inputs(grad_sqr=1.0, trace_sigma=3.0)
    for position in range(10, 1001, 10):
        tracker = tracker.update(**measurement, consumed_samples=position)
    assert tracker.measurements[0][0] == 250  # at 1,000: the last 750 samples (3/4 of the run so far)
    for position in range(1010, 4001, 10):
        tracker = tracker.update(**measurement, consumed_samples=position)
    assert tracker.measurements[0][0] == 3000  # at 4,000: the last 1,000 samples (500 base batches)
    assert tracker.noise_scale() == pytest.approx(3.0)


def test_the_averages_restart_once_the_warm_up_is_over():
    """While the LR rises the measurements count; min_samples measurements after its peak replace them."""
    tracker = NoiseScaleTracker(base_batch=8, min_samples=3, window=math.inf)  # the restart alone
    for step in range(5):  # warm-up: LR rising, |G|^2 = 100, tr(Sigma) = 0
        tracker = tracker.update_from_metrics(warm_record(step, lr=0.1 * (step + 1), small=100.0, big=100.0))
    assert tracker.warmup_end is None and tracker.noise_scale() == pytest.approx(0.0)
    for step in range(5, 8):  # after the peak: |G|^2 = 1, tr(Sigma) = 3
        tracker = tracker.update_from_metrics(warm_record(step, lr=0.5 - 0.01 * step, small=2.5, big=1.375))
        assert len(tracker.measurements) == (5 + step - 4 if step < 7 else 3)
    assert tracker.warmup_end == 5 * 8
    assert tracker.noise_scale() == pytest.approx(3.0)


def warm_record(step, *, lr, small, big):
    return {
        "consumed_samples": 8 * step, "lr": lr, "gns_small_sqr": small, "gns_big_sqr": big,
        "gns_small_batch": 2, "gns_big_batch": 8,
    }  # fmt: skip


def exact_inputs(grad_sqr: float, trace_sigma: float, small: int = 2, big: int = 8) -> dict:
    return {"small_sqr": grad_sqr + trace_sigma / small, "big_sqr": grad_sqr + trace_sigma / big,
            "small_batch": small, "big_batch": big}  # fmt: skip


def test_a_noise_scale_that_grows_along_the_window_is_reported_at_its_newest_value():
    """|G|^2 halving every 1,000 samples at constant tr(Sigma): the window's middle is half a window old
    (a GPT-125M run's average is 0.7-0.85 of the centred noise scale while it grows); the trend carries it to
    the end."""
    tracker = NoiseScaleTracker(base_batch=8, window=2_000.0)
    for position in range(8, 6_001, 8):
        tracker = tracker.update(**exact_inputs(2.0 ** (-position / 1_000), 10.0), consumed_samples=position)
    newest = 10.0 / 2.0 ** (-6_000 / 1_000)
    values = np.asarray([m[1:] for m in tracker.measurements])
    last_group = np.array_split(values[:, 0], 7)[-1].mean()  # its centre is 1/14 of the window back
    assert tracker.noise_scale() == pytest.approx(10.0 / last_group) == pytest.approx(newest, rel=0.10)
    window_middle = median_of_means(values[:, 1]) / median_of_means(values[:, 0])
    assert window_middle < 0.55 * newest  # what a plain average over the window would say


def test_the_trend_ignores_a_bad_group_stops_at_the_newest_group_and_needs_a_monotone_level():
    positions = np.arange(1.0, 71.0)
    values = np.column_stack([np.exp(-positions / 20.0), np.full(70, 5.0)])
    last_group = np.exp(-positions[60:] / 20.0).mean()
    grad_sqr, trace = at_newest(positions, values)
    # Carried along the slope to exp(-70 / 20), then held at the newest group's mean: never past it.
    assert grad_sqr == pytest.approx(last_group) and trace == pytest.approx(5.0)
    assert grad_sqr < median_of_means(values[:, 0]) and grad_sqr > np.exp(-70 / 20.0)
    spoiled = values.copy()
    spoiled[20:30, 0] = 50.0  # one group of outliers among seven: 17 of 21 pairs still fall
    assert at_newest(positions, spoiled)[0] == pytest.approx(last_group)
    # A level that only scatters (up, down, up, ...) has no trend: its plain median of means.
    zigzag = np.column_stack([1.0 + 0.5 * (np.arange(70) // 10 % 2), np.full(70, 5.0)])
    assert at_newest(positions, zigzag)[0] == pytest.approx(median_of_means(zigzag[:, 0]))
    # Four groups (8 values), a non-positive group mean, one position: the plain median of means.
    assert at_newest(positions[:8], values[:8])[0] == pytest.approx(median_of_means(values[:8, 0]))
    negative = values.copy()
    negative[:10, 0] = -1.0
    assert at_newest(positions, negative)[0] == pytest.approx(median_of_means(negative[:, 0]))
    assert at_newest(np.ones(70), values)[0] == pytest.approx(median_of_means(values[:, 0]))


def test_the_mann_kendall_test_asks_all_of_5_pairs_and_18_of_21():
    assert has_trend(np.ones(10), 5) and not has_trend(np.r_[np.ones(9), -1.0], 5)
    assert has_trend(np.r_[-np.ones(18), np.ones(3)], 7) and not has_trend(np.r_[np.ones(17), -np.ones(4)], 7)


def test_median_of_means_ignores_a_minority_of_bad_groups():
    values = np.concatenate([[-1e4, -1e4], np.ones(12)])
    assert median_of_means(values) == pytest.approx(1.0)
    assert median_of_means(np.array([2.0, 4.0])) == pytest.approx(3.0)  # one group: the plain mean
    assert median_of_means(np.arange(100.0)) == pytest.approx(np.arange(44, 58).mean())  # groups 15,15,14,..


def test_negative_grad_sqr_average_is_unknown_not_infinite():
    # small_sqr > big_sqr * big/small makes |G|^2 negative: pure noise, nothing to divide by.
    tracker = NoiseScaleTracker(base_batch=8, min_samples=1)
    for _ in range(5):
        tracker = tracker.update(small_sqr=10.0, big_sqr=0.5, small_batch=1, big_batch=8)
    assert tracker.estimate().grad_sqr < 0
    assert tracker.noise_scale() is None
    assert NoiseScaleEstimate(grad_sqr=0.0, trace_sigma=1.0, samples=9).noise_scale is None


def test_too_few_samples_is_unknown():
    tracker = NoiseScaleTracker(base_batch=8, min_samples=3)
    for count in range(3):
        assert tracker.noise_scale() is None, count
        tracker = tracker.update(small_sqr=5.0, big_sqr=2.0, small_batch=2, big_batch=8)
    assert tracker.noise_scale() == pytest.approx(8.0)  # |G|^2 = (16 - 10)/6 = 1, tr = 3/(1/2 - 1/8)


def test_updates_leave_the_old_tracker_alone_and_skip_bad_records():
    empty = NoiseScaleTracker(base_batch=8, min_samples=1)
    updated = empty.update(small_sqr=5.0, big_sqr=2.0, small_batch=2, big_batch=8)
    assert empty.samples == 0 and updated.samples == 1
    assert updated.update(small_sqr=float("inf"), big_sqr=2.0, small_batch=2, big_batch=8) is updated
    assert updated.update_from_metrics({"loss": 3.0, "gns_small_sqr": None}) is updated
    record = {"gns_small_sqr": 5.0, "gns_big_sqr": 2.0, "gns_small_batch": 2, "gns_big_batch": 8}
    assert updated.update_from_metrics(record).samples == 2
    with pytest.raises(PlanError, match="base_gbs"):
        NoiseScaleTracker(base_batch=0)


def test_efficiency_is_one_at_the_base_and_falls_with_batch():
    batches = np.array([16, 32, 64, 128, 1024])
    efficiency = statistical_efficiency(batches, noise_scale=100.0, base_batch=16)
    assert efficiency[0] == pytest.approx(1.0)
    assert efficiency[2] == pytest.approx(116 / 164)
    assert np.all(np.diff(efficiency) < 0)


def test_more_noise_makes_large_batches_more_efficient():
    noise = np.array([0.0, 10.0, 100.0, 1e4])
    efficiency = [float(statistical_efficiency(256, phi, 16)) for phi in noise]
    assert efficiency[0] == pytest.approx(16 / 256)
    assert np.all(np.diff(efficiency) > 0)


def test_progress_per_second_and_gain():
    assert float(progress_per_second(1000.0, 64, 48.0, 16)) == pytest.approx(1000.0 * 64 / 112)
    gains = adascale_gain(np.array([16, 64, 256]), 48.0, 16)
    assert gains.tolist() == pytest.approx([1.0, 64 / 28, 64 / 19])
    assert gains == pytest.approx(
        np.array([16, 64, 256]) / 16 * statistical_efficiency(np.array([16, 64, 256]), 48.0, 16)
    )
    with pytest.raises(PlanError, match="noise scale"):
        statistical_efficiency(32, float("inf"), 16)
