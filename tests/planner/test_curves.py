"""Statistical curves files: what they must hold, and the tokens each gbs needs to each loss."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tests.helpers.synthetic_curves import synthetic_curves

from cona.errors import PlanError
from cona.planner.curves import Curve, load_curves, parse_curves


def test_tokens_to_a_loss_interpolate_between_evaluations_on_the_best_loss_so_far():
    curve = Curve(
        gbs=16,
        tokens=np.array([100.0, 200.0, 300.0, 400.0]),
        eval_loss=np.array([5.0, 4.0, 4.5, 3.0]),  # a bump at 300: the best so far stays 4.0
        noise_scale=np.full(4, np.nan),
    )
    reached = curve.tokens_to_losses(np.array([5.0, 4.5, 4.0, 3.5, 2.0]))
    assert reached[:4].tolist() == pytest.approx([100.0, 150.0, 200.0, 350.0])
    assert reached[4] == np.inf


def test_the_ladder_starts_where_every_curve_has_evaluated_and_the_target_must_be_reached():
    curves = parse_curves(synthetic_curves(), source="synthetic")
    ladder = curves.ladder(3.0, 10)
    assert ladder[0] == min(float(c.eval_loss[0]) for c in curves.curves)
    assert ladder[-1] == 3.0 and np.all(np.diff(ladder) < 0)
    with pytest.raises(PlanError, match="no curve reaches the target loss 1"):
        curves.ladder(1.0, 10)


def test_the_noise_scale_is_what_the_run_had_reported_by_then():
    curve = Curve(gbs=8, tokens=np.array([10.0, 20.0]), eval_loss=np.array([4.0, 3.0]),
                  noise_scale=np.array([np.nan, 30.0]))  # fmt: skip
    assert curve.noise_at(5.0) is None and curve.noise_at(15.0) is None
    assert curve.noise_at(25.0).noise_scale == 30.0


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda raw: raw.update(kind="other"), "kind: must be 'cona statistical curves'"),
        (lambda raw: raw["model"].update(layerz=3), "model: must be an object with keys among"),
        (lambda raw: raw.update(base_gbs=0), "base_gbs: must be a positive integer"),
        (lambda raw: raw["curves"][0].update(gbs="16"), r"curves\[0\].gbs: must be a positive integer"),
        (
            lambda raw: raw["curves"][1]["tokens"].reverse(),
            r"curves\[1\].tokens: must be positive and increasing",
        ),
        (lambda raw: raw["curves"][0]["eval_loss"].pop(), r"curves\[0\]: tokens, eval_loss and noise_scale"),
        (lambda raw: raw["curves"][0]["eval_loss"].__setitem__(0, None), r"eval_loss: must hold finite"),
        (lambda raw: raw["curves"][1].update(gbs=raw["curves"][0]["gbs"]), "two curves have the same gbs"),
        (lambda raw: raw.pop("synthetic"), "synthetic: must be true or false"),
    ],
)
def test_a_bad_curves_file_is_one_line_naming_the_key(tmp_path, edit, message):
    raw = synthetic_curves(gbs_list=(16, 32))
    edit(raw)
    path = tmp_path / "curves.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(PlanError, match=message) as error:
        load_curves(path)
    assert "\n" not in str(error.value) and str(path) in str(error.value)


def test_a_missing_or_broken_file_is_named(tmp_path):
    with pytest.raises(PlanError, match="does not exist"):
        load_curves(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(PlanError, match="bad.json: not valid JSON"):
        load_curves(tmp_path / "bad.json")
