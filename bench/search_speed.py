"""Planner search benchmark: exhaustive search speed, and how close Bayesian optimisation gets with how few
evaluations.

    .venv/bin/python bench/search_speed.py                 # both parts, 100 BO searches
    .venv/bin/python bench/search_speed.py --searches 10   # a quicker BO sample
    .venv/bin/python bench/search_speed.py --crossover 5   # only where exhaustive gets as slow as BO

Speed: the exhaustive search (enumerate + one vectorised model call + ranking) for 8, 64, 512 and 4096 GPUs,
GPT 1.3B and a GPT-3 175B shape, at gbs 4096 and over the whole doubling frontier up to 4096. The reference
measured in the same run is one single-strategy model call, so "x evals" says how many one-at-a-time
evaluations the whole vectorised search costs.

Crossover (``--crossover K``): the exhaustive search's model call over tiled spaces of 100k to 2M strategies
against K random BO frontier searches of the default settings, which sets
:data:`cona.planner.search_choice.EXHAUSTIVE_UP_TO` (exhaustive below it, BO above, unless forced).

BO quality: random frontier searches (model, system, N, gbs drawn at random); each runs the exhaustive search
(the truth) and the Bayesian search with the module's default settings, and records the ratio of the times
predicted for their best strategies and the evaluations BO needed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from cona.config import ModelConfig
from cona.errors import PlanError
from cona.planner import search
from cona.planner.perf_model import predict
from cona.planner.space import enumerate_strategies
from cona.planner.systems import load_system
from cona.strategy import SCHEDULE_CODES, Strategy, StrategyArray

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
OPTION_FIELDS = ("dp", "tp", "pp", "mbs", "zero_stage", "recompute", "sequence_parallel", "virtual_stages")


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


CROSSOVER_SIZES = (100_000, 300_000, 1_000_000, 2_000_000)


def crossover_part(bo_searches: int, seed: int) -> dict:
    """Seconds of the exhaustive search's one model call over :data:`CROSSOVER_SIZES` strategies (a real
    175B space tiled: the per-candidate cost grows with the arrays), and of ``bo_searches`` BO searches."""
    system = load_system("a100_80g")
    model = MODELS["gpt-175b"]
    space = enumerate_strategies(model, 1024, 4096, gpus_per_node=system.gpus_per_node)
    exhaustive = {}
    for size in CROSSOVER_SIZES:
        rows = np.arange(size) % len(space)
        tiled = StrategyArray(
            **{name: getattr(space, name)[rows] for name in StrategyArray.__dataclass_fields__}
        )
        started = time.perf_counter()
        predict(model, tiled, system)
        exhaustive[size] = time.perf_counter() - started
        print(f"exhaustive model call over {size:>9,} strategies: {exhaustive[size]:7.3f} s", flush=True)
    bo_seconds = []
    for name, system_name, n_gpus, gbs in frontier_problems(bo_searches, seed):
        started = time.perf_counter()
        search.bayesian_search(MODELS[name], load_system(system_name), n_gpus, gbs, top_k=1)
        bo_seconds.append(time.perf_counter() - started)
        print(f"BO {name} {system_name} N={n_gpus} gbs={gbs}: {bo_seconds[-1]:.2f} s", flush=True)
    print(f"BO: fastest {min(bo_seconds):.2f} s, median {statistics.median(bo_seconds):.2f} s")
    return {"exhaustive_s": exhaustive, "bo_s": bo_seconds}


def random_frontier(rng: np.random.Generator) -> tuple[str, str, int, int]:
    name = str(rng.choice(list(MODELS)))
    system = str(rng.choice(BO_SYSTEMS))
    n_gpus = int(rng.choice(BO_GPUS))
    gbs_choices = [n_gpus * 2**k for k in range(13) if 16 <= n_gpus * 2**k <= MAX_GBS]
    return name, system, n_gpus, int(rng.choice(gbs_choices))


def frontier_problems(count: int, seed: int) -> list[tuple[str, str, int, int]]:
    """The first ``count`` random frontiers of ``seed`` where something fits (the same list for every
    version of the search, as long as the performance model is the same)."""
    rng = np.random.default_rng(seed)
    systems = {name: load_system(name) for name in BO_SYSTEMS}
    problems = []
    while len(problems) < count:
        name, system_name, n_gpus, gbs = random_frontier(rng)
        try:
            search.exhaustive_search(MODELS[name], systems[system_name], n_gpus, gbs, top_k=1)
        except PlanError:
            continue  # nothing fits (e.g. 175B on 8 GPUs): not a search BO could get right or wrong
        problems.append((name, system_name, n_gpus, gbs))
    return problems


def describe(strategy: Strategy) -> str:
    """Every option of a strategy, compactly."""
    extras = [f"z{strategy.zero_stage}", strategy.recompute]
    if strategy.sequence_parallel:
        extras.append("sp")
    if strategy.virtual_stages > 1:
        extras.append(f"v{strategy.virtual_stages}")
    return f"dp{strategy.dp}/tp{strategy.tp}/pp{strategy.pp} mbs{strategy.mbs} {' '.join(extras)}"


def best_of(model: ModelConfig, system, evaluated) -> tuple[Strategy, float] | None:
    """The fastest fitting strategy of ``evaluated`` (ties: less memory) and its time; None if none fits."""
    prediction = predict(model, evaluated, system)
    fits = np.flatnonzero(~prediction.oom)
    if len(fits) == 0:
        return None
    first = fits[np.lexsort((prediction.memory_gib[fits], prediction.iteration_time_s[fits]))[0]]
    return evaluated[int(first)], float(prediction.iteration_time_s[first])


def where_the_optimum_lies(
    model: ModelConfig, system, evaluated, found: Strategy, optimum: Strategy, n_gpus: int, gbs: int
) -> dict:
    """Why a search may miss: how much of the space fits, the rank of what it found among the fitting
    strategies, how many evaluations it spent on the optimum's (tp, pp) layout (and how many of those fit),
    and which options separate what it found from the optimum."""
    space = enumerate_strategies(model, n_gpus, gbs, gpus_per_node=system.gpus_per_node)
    full = predict(model, space, system)
    fitting_times = full.iteration_time_s[~full.oom]
    found_time = float(predict(model, found, system).iteration_time_s[0])
    same_layout = (evaluated.tp == optimum.tp) & (evaluated.pp == optimum.pp)
    fitting = ~predict(model, evaluated, system).oom
    return {
        "fitting_fraction": round(float(np.mean(~full.oom)), 3),
        "found_rank": int(np.sum(fitting_times < found_time * (1 - 1e-12))) + 1,
        "optimum_layout_evaluations": int(same_layout.sum()),
        "optimum_layout_fitting": int(np.sum(same_layout & fitting)),
        "options_differing": [f for f in OPTION_FIELDS if getattr(found, f) != getattr(optimum, f)],
    }


def bo_part(
    searches: int, seed: int, progress_path: str | None = None, only: list[int] | None = None
) -> list[dict]:
    """Random frontier searches (numbered from 1; ``only`` runs just those numbers); with
    ``progress_path``, the rows so far are rewritten there after each.

    Each row has the search's result before its local refinement ("global": the bootstrap and GP phase,
    which is the whole search with ``max_local_rounds=0``, evaluation for evaluation) and after it."""
    systems = {name: load_system(name) for name in BO_SYSTEMS}
    rows: list[dict] = []
    for number, (name, system_name, n_gpus, gbs) in enumerate(frontier_problems(searches, seed), start=1):
        if only and number not in only:
            continue
        system, model = systems[system_name], MODELS[name]
        started = time.perf_counter()
        truth = search.exhaustive_search(model, system, n_gpus, gbs, top_k=1)
        exhaustive_seconds = time.perf_counter() - started
        started = time.perf_counter()
        found = search.bayesian_search(model, system, n_gpus, gbs, top_k=1, seed=number - 1)
        seconds = time.perf_counter() - started
        optimum_s = float(truth.prediction.iteration_time_s[0])
        global_evaluations = found.evaluations - found.refinement_evaluations
        global_best = best_of(model, system, found.evaluated.select(np.arange(global_evaluations)))
        row = {
            "number": number,
            "model": name,
            "system": system_name,
            "gpus": n_gpus,
            "gbs": gbs,
            "space_size": truth.space_size,
            "evaluations": found.evaluations,
            "global_evaluations": global_evaluations,
            "ratio": float(found.prediction.iteration_time_s[0]) / optimum_s,
            "global_ratio": global_best[1] / optimum_s if global_best else float("inf"),
            "seconds": seconds,
            "exhaustive_seconds": exhaustive_seconds,
            "bo_best": describe(found.best),
            "global_best": describe(global_best[0]) if global_best else "none fits",
            "exhaustive_best": describe(truth.best),
            "exhaustive_time_s": optimum_s,
            "evaluated": {f: getattr(found.evaluated, f).tolist() for f in OPTION_FIELDS},
        }
        print(
            f"{number:>3} {name:9} {system_name:9} N={n_gpus:<5} gbs={gbs:<5} space={truth.space_size:<6} "
            f"evals={global_evaluations:<3}->{found.evaluations:<3} ratio={row['global_ratio']:.4f}->"
            f"{row['ratio']:.4f} {seconds:.1f} s",
            flush=True,
        )
        phases = (
            ("global", global_best, global_evaluations),
            ("refined", (found.best, 0.0), found.evaluations),
        )
        for phase, best, count in phases:
            ratio = row["global_ratio"] if phase == "global" else row["ratio"]
            if best is not None and ratio > 1.02:
                evaluated = found.evaluated.select(np.arange(count))
                row[f"{phase}_miss"] = where_the_optimum_lies(
                    model, system, evaluated, best[0], truth.best, n_gpus, gbs
                )
                print(
                    f"    {phase} miss: optimum {row['exhaustive_best']}, found {describe(best[0])}; "
                    f"{json.dumps(row[f'{phase}_miss'])}",
                    flush=True,
                )
        rows.append(row)
        if progress_path:
            with open(progress_path, "w") as handle:
                json.dump({"bo": rows}, handle, indent=2)
    return rows


def evaluated_of(row: dict, count: int) -> StrategyArray:
    """The first ``count`` strategies a recorded search evaluated (its row's ``evaluated`` columns)."""
    columns = {field: np.asarray(values[:count]) for field, values in row["evaluated"].items()}
    interleaved = columns["virtual_stages"] > 1
    return StrategyArray(
        **columns,
        gbs=np.full(count, row["gbs"]),
        pipeline_schedule=np.where(interleaved, SCHEDULE_CODES["interleaved_1f1b"], SCHEDULE_CODES["1f1b"]),
    )


def print_misses(rows: list[dict]) -> None:
    """A Markdown table of the searches more than 2% off, before (global) and after the refinement."""
    print(
        "| # | model | system | N | gbs | phase | ratio | evaluations | optimum | found | fitting share "
        "| found's rank | optimum's layout evaluated (fitting) | options differing |"
    )
    print("|---:|---|---|---:|---:|---|---:|---:|---|---|---:|---:|---|---|")
    for row in rows:
        model, system = MODELS[row["model"]], load_system(row["system"])
        for phase, ratio_key, count_key in (("global", "global_ratio", "global_evaluations"),
                                            ("refined", "ratio", "evaluations")):  # fmt: skip
            if row[ratio_key] <= 1.02:
                continue
            evaluated = evaluated_of(row, row[count_key])
            found, _ = best_of(model, system, evaluated)
            truth = search.exhaustive_search(model, system, row["gpus"], row["gbs"], top_k=1).best
            why = where_the_optimum_lies(model, system, evaluated, found, truth, row["gpus"], row["gbs"])
            problem = f"{row['number']} | {row['model']} | {row['system']} | {row['gpus']} | {row['gbs']}"
            print(
                f"| {problem} | {phase} | {row[ratio_key]:.3f} | {row[count_key]} | {describe(truth)} "
                f"| {describe(found)} | {why['fitting_fraction']:.2f} | {why['found_rank']} "
                f"| {why['optimum_layout_evaluations']} ({why['optimum_layout_fitting']}) "
                f"| {', '.join(why['options_differing'])} |"
            )


def summarise_bo(rows: list[dict]) -> dict:
    """Quality and cost before the local refinement (the global phase) and after it."""
    summary: dict = {"searches": len(rows)}
    for phase, ratio_key, evaluations_key in (
        ("global", "global_ratio", "global_evaluations"),
        ("refined", "ratio", "evaluations"),
    ):
        ratios = [row[ratio_key] for row in rows]
        evaluations = [row[evaluations_key] for row in rows]
        summary[phase] = {
            "within_2_percent": sum(ratio <= 1.02 for ratio in ratios),
            "exact_optimum": sum(ratio <= 1.0 + 1e-12 for ratio in ratios),
            "within_5_percent": sum(ratio <= 1.05 for ratio in ratios),
            "worst_ratio": max(ratios),
            "evaluations_median": statistics.median(evaluations),
            "evaluations_mean": statistics.fmean(evaluations),
            "evaluations_max": max(evaluations),
            "evaluations_total": sum(evaluations),
        }
    summary.update(
        {
            "space_size_median": statistics.median(row["space_size"] for row in rows),
            "space_total": sum(row["space_size"] for row in rows),
            "seconds_per_search_median": statistics.median(row["seconds"] for row in rows),
            "seconds_per_search_max": max(row["seconds"] for row in rows),
            "bo_seconds_total": sum(row["seconds"] for row in rows),
            "exhaustive_seconds_total": sum(row["exhaustive_seconds"] for row in rows),
            "settings": {
                "BOOTSTRAP_SAMPLES": search.BOOTSTRAP_SAMPLES,
                "EI_STOP_FRACTION": search.EI_STOP_FRACTION,
                "MAX_GP_UPDATES": search.MAX_GP_UPDATES,
                "MAX_LOCAL_ROUNDS": search.MAX_LOCAL_ROUNDS,
            },
        }
    )
    print(json.dumps(summary, indent=2))
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--searches", type=int, default=100, help="random BO frontier searches (default 100)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random frontiers")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--skip-bo", action="store_true")
    parser.add_argument("--only", type=int, nargs="*", help="run only these search numbers (from 1)")
    parser.add_argument(
        "--crossover", type=int, default=None, metavar="K", help="only the crossover part, K BO searches"
    )
    parser.add_argument("--json-out", default=None, help="also write every row and the summary here")
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="only summarise these --json-out files")
    args = parser.parse_args()
    if args.merge:
        rows = [row for path in args.merge for row in json.loads(Path(path).read_text())["bo"]]
        rows = sorted(rows, key=lambda row: row["number"])
        print_misses(rows)
        summarise_bo(rows)
        return
    if args.crossover is not None:
        crossover_part(args.crossover, args.seed)
        return
    output: dict = {}
    if not args.skip_speed:
        output["speed"] = speed_part()
    if not args.skip_bo:
        output["bo"] = bo_part(args.searches, args.seed, args.json_out, args.only)
        summary = summarise_bo(output["bo"])
        # What the evaluation counts would cost if each evaluation were one model call, as in BO.
        reference = single_call_seconds(MODELS["gpt-1.3b"], load_system("a100_80g"))
        summary["single_call_s"] = reference
        summary["one_call_per_strategy_exhaustive_s"] = summary["space_total"] * reference
        print(
            f"one single-strategy model call {reference * 1e3:.3f} ms: one call per strategy over all spaces "
            f"would take {summary['space_total'] * reference:.0f} s; BO took "
            f"{summary['bo_seconds_total']:.0f} s, the vectorised exhaustive searches "
            f"{summary['exhaustive_seconds_total']:.1f} s"
        )
        output["bo_summary"] = summary
    if args.json_out:
        with open(args.json_out, "w") as handle:
            json.dump(output, handle, indent=2)


if __name__ == "__main__":
    main()
