import pytest

from cona.config import TrainingConfig
from cona.errors import PlanError
from cona.planner.efficiency import NoiseScaleEstimate
from cona.planner.lr_scaling import scaled_lr


def training(**overrides) -> TrainingConfig:
    values = dict(base_gbs=16, base_lr=2e-4, base_min_lr=2e-5, scale_min_lr=True)
    values.update(overrides)
    return TrainingConfig(**values)


@pytest.mark.parametrize(
    ("rule", "extra", "gbs", "factor"),
    [
        ("linear", {}, 64, 4.0),
        ("linear", {}, 8, 0.5),
        ("sqrt", {}, 64, 2.0),
        ("sqrt", {}, 4, 0.5),
        ("power", {"lr_scale_exp": 0.75}, 256, 8.0),  # 16 ** 0.75
        ("power", {"lr_scale_exp": 0.0}, 256, 1.0),
    ],
)
def test_closed_form_rules(rule, extra, gbs, factor):
    result = scaled_lr(training(lr_scale_strategy=rule, **extra), gbs)
    assert result.factor == pytest.approx(factor)
    assert result.lr == pytest.approx(2e-4 * factor)
    assert result.min_lr == pytest.approx(2e-5 * factor)
    assert result.min_lr_factor == pytest.approx(factor)
    assert not result.capped


def test_same_batch_keeps_base_lrs_for_every_rule():
    for rule in ("linear", "sqrt", "power", "piecewise", "adascale"):
        config = training(lr_scale_strategy=rule, lr_scale_pivot_gbs=64)
        estimate = NoiseScaleEstimate(grad_sqr=1.0, trace_sigma=100.0, samples=50)
        result = scaled_lr(config, 16, noise_scale=estimate)
        assert (result.lr, result.min_lr, result.factor) == pytest.approx((2e-4, 2e-5, 1.0)), rule


def piecewise(**extra) -> TrainingConfig:
    return training(
        lr_scale_strategy="piecewise",
        lr_scale_pivot_gbs=64,
        lr_scale_low_exp=1.0,
        lr_scale_high_exp=0.5,
        **extra,
    )


def test_piecewise_below_and_above_the_pivot():
    config = piecewise()
    assert scaled_lr(config, 32).factor == pytest.approx(2.0)  # (32/16)^1
    assert scaled_lr(config, 64).factor == pytest.approx(4.0)  # (64/16)^1
    assert scaled_lr(config, 256).factor == pytest.approx(8.0)  # 4 * (256/64)^0.5
    assert scaled_lr(config, 8).factor == pytest.approx(0.5)  # below the base: low exponent


def test_piecewise_is_continuous_at_the_pivot():
    # Just below the pivot the low branch gives 63/16; just above, the high branch continues from 4 at the
    # pivot. A rule restarting the high branch from base_lr would give (65/16)^0.5 ~ 2.0 above it instead.
    config = piecewise()
    below, at, above = (scaled_lr(config, gbs).factor for gbs in (63, 64, 65))
    assert below == pytest.approx(63 / 16)
    assert at == pytest.approx(4.0)
    assert above == pytest.approx(4.0 * (65 / 64) ** 0.5)
    assert above - below < 0.1


def test_piecewise_with_the_base_above_the_pivot():
    # base 256 > pivot 64: above the pivot only the high exponent applies, below it both; anchored at base.
    config = training(
        lr_scale_strategy="piecewise",
        base_gbs=256,
        lr_scale_pivot_gbs=64,
        lr_scale_low_exp=1.0,
        lr_scale_high_exp=0.5,
    )
    assert scaled_lr(config, 1024).factor == pytest.approx(2.0)  # (1024/256)^0.5
    assert scaled_lr(config, 64).factor == pytest.approx(0.5)  # (64/256)^0.5
    assert scaled_lr(config, 32).factor == pytest.approx(0.25)  # (64/256)^0.5 * (32/64)^1


def test_cap_bounds_lr_and_min_lr_never_exceeds_lr():
    config = training(lr_scale_strategy="linear", lr_scale_lr_cap=5e-4, base_min_lr=1.5e-4)
    result = scaled_lr(config, 64)  # uncapped 8e-4, min 6e-4
    assert result.lr == pytest.approx(5e-4)
    assert result.capped
    assert result.factor == pytest.approx(4.0)
    assert result.min_lr == pytest.approx(5e-4)  # 6e-4 clamped to the capped lr


def test_cap_above_the_result_changes_nothing():
    result = scaled_lr(training(lr_scale_strategy="sqrt", lr_scale_lr_cap=1e-2), 64)
    assert result.lr == pytest.approx(4e-4) and not result.capped


def test_scale_min_lr_off_keeps_base_min_lr():
    result = scaled_lr(training(lr_scale_strategy="linear", scale_min_lr=False), 64)
    assert result.lr == pytest.approx(8e-4)
    assert result.min_lr == pytest.approx(2e-5)
    assert result.min_lr_factor == 1.0


def test_scale_min_lr_off_still_clamps_when_lr_shrinks():
    result = scaled_lr(training(lr_scale_strategy="linear", scale_min_lr=False, base_min_lr=1.5e-4), 8)
    assert result.lr == pytest.approx(1e-4)
    assert result.min_lr == pytest.approx(1e-4)


def test_adascale_gain_from_a_measured_noise_scale():
    # phi = tr(Sigma)/|G|^2 = 48 samples, M0 = 16, s = 4: r = (48 + 16) / (48/4 + 16) = 64/28.
    estimate = NoiseScaleEstimate(grad_sqr=2.0, trace_sigma=96.0, samples=100)
    result = scaled_lr(training(lr_scale_strategy="adascale"), 64, noise_scale=estimate)
    assert result.factor == pytest.approx(64 / 28)
    assert result.lr == pytest.approx(2e-4 * 64 / 28)


def test_adascale_without_a_usable_estimate_is_conservative():
    config = training(lr_scale_strategy="adascale")
    negative = NoiseScaleEstimate(grad_sqr=-1e-3, trace_sigma=5.0, samples=100)
    for estimate in (None, negative):
        assert scaled_lr(config, 64, noise_scale=estimate).factor == 1.0  # not the gain s = 4
        assert scaled_lr(config, 4, noise_scale=estimate).factor == pytest.approx(0.25)


def test_adascale_gain_lies_between_one_and_scale():
    config = training(lr_scale_strategy="adascale")
    for trace in (0.0, 1.0, 100.0, 1e6):
        estimate = NoiseScaleEstimate(grad_sqr=1.0, trace_sigma=trace, samples=100)
        assert 1.0 <= scaled_lr(config, 128, noise_scale=estimate).factor <= 8.0


def test_bad_gbs_is_refused():
    with pytest.raises(PlanError, match="gbs=0"):
        scaled_lr(training(), 0)
