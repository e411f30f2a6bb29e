"""The online summary's account of what each stage's predicted tokens/s rested on."""

from __future__ import annotations

from cona.runner.views.online_report import prediction_basis


def test_a_prediction_names_what_it_rested_on():
    assert prediction_basis({"throughput_source": "predicted", "fitted_on": 0}) == "prior"
    assert prediction_basis({"throughput_source": "predicted", "fitted_on": 3}) == "fit on 3"
    assert prediction_basis({"throughput_source": "measured", "fitted_on": 3}) == "measured"
    assert prediction_basis({"throughput_source": "predicted"}) == "prior"  # a record from before fitted_on
    fallback = {"throughput_source": "predicted", "fitted_on": 0, "action": "fallback"}
    assert prediction_basis(fallback) == "as before"  # back to a stage whose rate was never measured
