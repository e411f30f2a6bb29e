"""Planner search benchmark: exhaustive search speed, and how close Bayesian optimisation gets with how few
evaluations.

    .venv/bin/python bench/search_speed.py                 # both parts, 100 BO searches
    .venv/bin/python bench/search_speed.py --searches 10   # a quicker BO sample

Speed: the exhaustive search (enumerate + one vectorised model call + ranking) for 8, 64, 512 and 4096 GPUs,
GPT 1.3B and a GPT-3 175B shape, at gbs 4096 and over the whole doubling frontier up to 4096. The reference
measured in the same run is one single-strategy model call, so "x evals" says how many one-at-a-time
evaluations the whole vectorised search costs.

BO quality: random frontier searches (model, system, N, gbs drawn at random); each runs the exhaustive search
(the truth) and the Bayesian search with the module's default settings, and records the ratio of the times
predicted for their best strategies and the evaluations BO needed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from cona.config import ModelConfig
from cona.errors import PlanError
from cona.planner import search
from cona.planner.perf_model import predict
from cona.planner.space import enumerate_strategies
from cona.planner.systems import load_system

MODELS = {
    "gpt-350m": ModelConfig(name="gpt-350m", layers=24, hidden=1024, heads=16, seq=2048, vocab_size=50257),
    "gpt-1.3b": ModelConfig(name="gpt-1.3b", layers=24, hidden=2048, heads=16, seq=2048, vocab_size=50257),
    "gpt-6.7b": ModelConfig(name="gpt-6.7b", layers=32, hidden=4096, heads=32, seq=2048, vocab_size=50257),
    "gpt-13b": ModelConfig(name="gpt-13b", layers=40, hidden=5120, heads=40, seq=2048, vocab_size=50257),
    "gpt-175b": ModelConfig(name="gpt-175b", layers=96, hidden=12288, heads=96, seq=2048, vocab_size=50257),
}
SPEED_GPUS = (8, 64, 512, 4096)
MAX_GBS = 4096
BO_GPUS = (8, 16, 32, 64, 128, 256, 512, 1024)
BO_SYSTEMS = ("a100_80g", "h100_80g")


def timed_exhaustive(model: ModelConfig, system, n_gpus: int, gbs: int) -> tuple[float, str, int]:
    """Seconds of one exhaustive search, its winner (or why none), and the space size."""
    started = time.perf_counter()
    try:
        result = search.exhaustive_search(model, system, n_gpus, gbs, top_k=1)
        winner, size = (
            f"{result.best.short()} {result.prediction.iteration_time_s[0]:.3g} s",
            result.space_size,
        )
    except PlanError as error:
        size = len(enumerate_strategies(model, n_gpus, gbs, gpus_per_node=system.gpus_per_node))
        winner = f"none ({str(error)[:40]}...)"
    return time.perf_counter() - started, winner, size


def single_call_seconds(model: ModelConfig, system, repeats: int = 200) -> float:
    space = enumerate_strategies(model, 64, 512, gpus_per_node=system.gpus_per_node)
    started = time.perf_counter()
    for index in range(repeats):
        predict(model, space.select(np.array([index % len(space)])), system)
    return (time.perf_counter() - started) / repeats


def speed_part() -> list[dict]:
    system = load_system("a100_80g")
    reference = single_call_seconds(MODELS["gpt-1.3b"], system)
    print(f"reference: one single-strategy model call = {reference * 1e3:.3f} ms")
    print(
        f"{'model':9} {'GPUs':>5} {'space':>6} {'gbs 4096 s':>10} {'x evals':>8} {'frontier s':>10}"
        "  best at gbs 4096"
    )
    rows = []
    for name in ("gpt-1.3b", "gpt-175b"):
        for n_gpus in SPEED_GPUS:
            seconds, winner, size = timed_exhaustive(MODELS[name], system, n_gpus, MAX_GBS)
            frontier = [n_gpus * 2**k for k in range(13) if n_gpus * 2**k <= MAX_GBS]
            frontier_seconds = sum(timed_exhaustive(MODELS[name], system, n_gpus, g)[0] for g in frontier)
            print(
                f"{name:9} {n_gpus:>5} {size:>6} {seconds:>10.4f} {seconds / reference:>8.1f} "
                f"{frontier_seconds:>10.4f}  {winner}"
            )
            rows.append(
                {
                    "model": name,
                    "gpus": n_gpus,
                    "gbs": MAX_GBS,
                    "space_size": size,
                    "seconds": seconds,
                    "frontier_gbs": frontier,
                    "frontier_seconds": frontier_seconds,
                    "best": winner,
                    "reference_single_call_s": reference,
                }
            )
    return rows


def random_frontier(rng: np.random.Generator) -> tuple[str, str, int, int]:
    name = str(rng.choice(list(MODELS)))
    system = str(rng.choice(BO_SYSTEMS))
    n_gpus = int(rng.choice(BO_GPUS))
    gbs_choices = [n_gpus * 2**k for k in range(13) if 16 <= n_gpus * 2**k <= MAX_GBS]
    return name, system, n_gpus, int(rng.choice(gbs_choices))


def bo_part(searches: int, seed: int, progress_path: str | None = None) -> list[dict]:
    """Random frontier searches; with ``progress_path``, the rows so far are rewritten there after each."""
    rng = np.random.default_rng(seed)
    systems = {name: load_system(name) for name in BO_SYSTEMS}
    rows: list[dict] = []
    while len(rows) < searches:
        name, system_name, n_gpus, gbs = random_frontier(rng)
        system = systems[system_name]
        try:
            truth = search.exhaustive_search(MODELS[name], system, n_gpus, gbs, top_k=1)
        except PlanError:
            continue  # nothing fits (e.g. 175B on 8 GPUs): not a search BO could get right or wrong
        started = time.perf_counter()
        found = search.bayesian_search(MODELS[name], system, n_gpus, gbs, top_k=1, seed=len(rows))
        seconds = time.perf_counter() - started
        ratio = float(found.prediction.iteration_time_s[0] / truth.prediction.iteration_time_s[0])
        rows.append(
            {
                "model": name,
                "system": system_name,
                "gpus": n_gpus,
                "gbs": gbs,
                "space_size": truth.space_size,
                "evaluations": found.evaluations,
                "ratio": ratio,
                "seconds": seconds,
                "bo_best": found.best.short(),
                "exhaustive_best": truth.best.short(),
            }
        )
        print(
            f"{len(rows):>3} {name:9} {system_name:9} N={n_gpus:<5} gbs={gbs:<5} space={truth.space_size:<6} "
            f"evals={found.evaluations:<3} ratio={ratio:.4f} {seconds:.1f} s",
            flush=True,
        )
        if progress_path:
            with open(progress_path, "w") as handle:
                json.dump({"bo": rows}, handle, indent=2)
    return rows


def summarise_bo(rows: list[dict]) -> dict:
    ratios = [row["ratio"] for row in rows]
    evaluations = [row["evaluations"] for row in rows]
    fractions = [row["evaluations"] / row["space_size"] for row in rows]
    summary = {
        "searches": len(rows),
        "within_2_percent": sum(ratio <= 1.02 for ratio in ratios) / len(rows),
        "exact_optimum": sum(ratio <= 1.0 + 1e-12 for ratio in ratios) / len(rows),
        "worst_ratio": max(ratios),
        "evaluations_median": statistics.median(evaluations),
        "evaluations_mean": statistics.fmean(evaluations),
        "evaluations_max": max(evaluations),
        "space_fraction_median": statistics.median(fractions),
        "space_size_median": statistics.median(row["space_size"] for row in rows),
        "seconds_per_search_median": statistics.median(row["seconds"] for row in rows),
        "settings": {
            "BOOTSTRAP_SAMPLES": search.BOOTSTRAP_SAMPLES,
            "EI_STOP_FRACTION": search.EI_STOP_FRACTION,
            "MAX_GP_UPDATES": search.MAX_GP_UPDATES,
        },
    }
    print(json.dumps(summary, indent=2))
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--searches", type=int, default=100, help="random BO frontier searches (default 100)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random frontiers")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--skip-bo", action="store_true")
    parser.add_argument("--json-out", default=None, help="also write every row and the summary here")
    args = parser.parse_args()
    output: dict = {}
    if not args.skip_speed:
        output["speed"] = speed_part()
    if not args.skip_bo:
        output["bo"] = bo_part(args.searches, args.seed, args.json_out)
        output["bo_summary"] = summarise_bo(output["bo"])
    if args.json_out:
        with open(args.json_out, "w") as handle:
            json.dump(output, handle, indent=2)


if __name__ == "__main__":
    main()
