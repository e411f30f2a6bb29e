"""What online mode's estimator predicts for an eager run's larger batches from the ones it measured first.

The points are GPT-125M, seq 512, bf16, eager on one H200 (docs/benchmarks.md, "Online vs fixed on the H200,
eager and compiled", call 4: medians of an online run's metrics lines, one stage per gbs, mbs = gbs). For the
profile the run gets (``planner.profiles.run_profile``: no CUDA graphs, the run is eager) and for the graph
profile every prediction used before, the estimator is fitted on the first k measured points and predicts the
others; printed as predicted / measured. Then, for the rates two online runs decided on (``DECISION_RATES``),
gbs 32 predicted from gbs 8 and 16. Runs on a CPU in a second::

    PYTHONPATH=src .venv/bin/python bench/eager_prediction.py
"""

from __future__ import annotations

from cona.config import ModelConfig, TrainingConfig
from cona.planner.profiles import run_profile
from cona.planner.step_parts import model_step_parts
from cona.planner.systems import load_system
from cona.planner.throughput import Point, ThroughputEstimator, fitted_forms
from cona.strategy import Strategy

GPT_125M = ModelConfig(name="gpt-125m", layers=12, hidden=768, heads=12, seq=512, vocab_size=50304)
MEASURED_TOKENS_PER_S = {8: 109_338, 16: 209_946, 32: 324_866, 64: 357_357}
DECISION_RATES = {
    "eighth session, call 1": {8: 73_373, 16: 143_018, 32: 319_146},
    "eighth session, call 2": {8: 98_409, 16: 184_075, 32: 321_101},
}
"""The rates two online runs' gbs-32 decisions used for gbs 8 and 16 (``decisions.jsonl``, eager H200 runs of
docs/benchmarks.md, eighth session) and gbs 32's measured rate (the online summary): the free fit put gbs 32
at 0.49 and 0.64 of it."""


def main() -> None:
    h200 = load_system("h200_141g")
    order = sorted(MEASURED_TOKENS_PER_S)
    strategies = {g: Strategy(dp=1, tp=1, pp=1, mbs=g, gbs=g) for g in order}
    for label, training in (
        ("the run's (eager)", TrainingConfig(compile=False)),
        ("graphs", TrainingConfig()),
    ):
        profile = run_profile("native", training)
        parts = {g: model_step_parts(GPT_125M, [strategies[g]], h200, "bf16", backend=profile) for g in order}
        print(f"profile: {label}")
        for known in range(len(order)):
            points = [
                Point(
                    strategy=strategies[g],
                    tokens_per_s=MEASURED_TOKENS_PER_S[g],
                    model=parts[g],
                    source=str(g),
                )
                for g in order[:known]
            ]
            forms = fitted_forms(h200, profile)  # the forms the run fits (overlap: an accelerator)
            estimator = ThroughputEstimator(seq=GPT_125M.seq, forms=forms).with_points(points)
            ratios = []
            for g in order[known:]:
                predicted = estimator.estimate(strategies[g], parts[g]).tokens_per_s
                ratios.append(f"gbs {g} {predicted / MEASURED_TOKENS_PER_S[g]:.2f}")
            fitted = f"fitted on gbs {', '.join(map(str, order[:known]))}" if known else "nothing measured"
            print(f"  {fitted}: predicted / measured {', '.join(ratios)}")
    profile = run_profile("native", TrainingConfig(compile=False))
    for label, rates in DECISION_RATES.items():
        order = sorted(rates)
        parts = {g: model_step_parts(GPT_125M, [strategies[g]], h200, "bf16", backend=profile) for g in order}
        points = [
            Point(strategy=strategies[g], tokens_per_s=rates[g], model=parts[g], source=str(g))
            for g in order[:2]
        ]
        estimator = ThroughputEstimator(seq=GPT_125M.seq, forms=fitted_forms(h200, profile)).with_points(
            points
        )
        predicted = estimator.estimate(strategies[32], parts[32]).tokens_per_s
        print(f"{label}, fitted on gbs 8, 16: predicted / measured gbs 32 {predicted / rates[32]:.2f}")


if __name__ == "__main__":
    main()
