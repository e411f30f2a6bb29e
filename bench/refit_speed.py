"""How long the online search's refit takes, and whether the faster solver finds the same fits.

Every new measured rate refits the throughput estimator's shape (:func:`cona.planner.step_shape.fit_shape`)
in the runner's search thread, so the decision on that metrics line waits for it; on the demo's 2-core CPU,
where the four workers use the cores, the old solver made a decision 0.5-4 s late (issue 16). Two point sets,
each added one at a time as a run measures them:

* ``demo``: the tiny GPT on 4 CPU processes (``cpu_gloo``, both forms), rates from a ``cona demo`` run;
* ``h200``: GPT-125M eager on one H200 (overlap form), the rates of ``bench/eager_prediction.py``.

For each, the solver the estimator uses and the reference measured in the same run (trust-region
reflective with a numerical Jacobian, the solver before c073c8e): seconds per refit, their ratio, and the
fits' costs (the lower one is the better fit of the same objective)::

    PYTHONPATH=src .venv/bin/python bench/refit_speed.py --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from cona.config import ModelConfig, TrainingConfig
from cona.planner.profiles import run_profile
from cona.planner.step_parts import StepParts, model_step_parts
from cona.planner.step_shape import LEAST_SQUARES, fit_cost
from cona.planner.systems import load_system
from cona.planner.throughput import fitted_forms
from cona.strategy import Strategy

REFERENCE_SOLVER = {"method": "trf", "jac": "2-point", "diff_step": 1e-4}
TINY = ModelConfig(name="gpt-tiny", layers=4, hidden=64, heads=4, seq=128, vocab_size=4096)
GPT_125M = ModelConfig(name="gpt-125m", layers=12, hidden=768, heads=12, seq=512, vocab_size=50304)
DEMO_TOKENS_PER_S = [
    (Strategy(dp=1, tp=4, pp=1, mbs=1, gbs=1), 400.0),
    (Strategy(dp=2, tp=2, pp=1, mbs=1, gbs=2), 700.0),
    (Strategy(dp=4, tp=1, pp=1, mbs=1, gbs=4), 2_200.0),
    (Strategy(dp=4, tp=1, pp=1, mbs=2, gbs=8), 5_000.0),
    (Strategy(dp=4, tp=1, pp=1, mbs=4, gbs=16), 6_600.0),
    (Strategy(dp=4, tp=1, pp=1, mbs=8, gbs=32), 10_000.0),
]
"""Rounded rates of a ``cona demo`` run's stages (its online summary table)."""
H200_TOKENS_PER_S = [
    (Strategy(dp=1, tp=1, pp=1, mbs=g, gbs=g), rate)
    for g, rate in ((8, 109_338), (16, 209_946), (32, 324_866), (64, 357_357))
]


def point_set(name: str) -> tuple[StepParts, np.ndarray, tuple[str, ...]]:
    """The model's parts of a set's strategies, their measured step seconds and the forms the run fits."""
    training = TrainingConfig(compile=False)
    profile = run_profile("native", training)
    if name == "demo":
        model, system, dtype, measured = TINY, load_system("cpu_gloo"), "fp32", DEMO_TOKENS_PER_S
    else:
        model, system, dtype, measured = GPT_125M, load_system("h200_141g"), "bf16", H200_TOKENS_PER_S
    strategies = [strategy for strategy, _ in measured]
    parts = model_step_parts(model, strategies, system, dtype, backend=profile)
    step_s = np.array([s.gbs * model.seq / rate for s, rate in measured])
    return parts, step_s, fitted_forms(system, profile)


def refits(parts: StepParts, step_s: np.ndarray, forms, solver: dict, repeats: int) -> list[tuple]:
    """Per number of points (2 and up): (median seconds of one refit, the best form's cost)."""
    rows = []
    for known in range(2, len(step_s) + 1):
        subset = parts.take(np.arange(known))
        seconds, cost = [], None
        for _ in range(repeats):
            started = time.perf_counter()
            cost = min(fit_cost(form, subset, step_s[:known], solver) for form in forms)
            seconds.append(time.perf_counter() - started)
        rows.append((known, statistics.median(seconds), cost))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    for name in ("demo", "h200"):
        parts, step_s, forms = point_set(name)
        ours = refits(parts, step_s, forms, LEAST_SQUARES, args.repeats)
        reference = refits(parts, step_s, forms, REFERENCE_SOLVER, args.repeats)
        print(f"{name} ({', '.join(forms)}): points, refit s (reference), speed-up, cost (reference)")
        for (known, seconds, cost), (_, ref_seconds, ref_cost) in zip(ours, reference, strict=True):
            print(
                f"  {known}: {seconds:.3f} s ({ref_seconds:.3f} s), {ref_seconds / seconds:.1f}x, "
                f"{cost:.3g} ({ref_cost:.3g})"
            )


if __name__ == "__main__":
    main()
