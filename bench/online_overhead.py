"""Does the online search slow training down? Step times of one fixed stage with and without the search.

Runs the tiny GPT (examples/tiny/.conaconfig, demo data) on 4 CPU processes at dp4 gbs 8 for ``--iters``
iterations, alternating runs without and with a :class:`cona.runner.schedules.online_search.StageSearch`
thread in
the runner process (BoTorch search, the performance model recalibrated as the throughput moves, a noise
scale floor so that every evaluation searches the frontier, and a switch cost so large that it never
switches). Prints the median step time of each run (first log interval left out), the ratio with/without
per pair, and the CPU seconds the runner process (the search thread) used.

    .venv/bin/python bench/online_overhead.py --pairs 3 --iters 60
"""

from __future__ import annotations

import argparse
import resource
import statistics
import tempfile
import time
from pathlib import Path

from cona.config.file import load_config
from cona.engine.spec import StageSpec
from cona.planner.efficiency import NoiseScaleTracker
from cona.planner.policy import Candidate, PolicySettings, initial_state
from cona.planner.systems import load_system
from cona.runner.launch import Topology, run_stage
from cona.runner.run_dir import resolve_log_root
from cona.runner.schedules.online_search import Budget, FrontierSearch, StageSearch
from cona.strategy import Strategy

ROOT = Path(__file__).resolve().parents[1]


def one_run(config, iters: int, *, with_search: bool, port: int) -> tuple[float, float]:
    """(median step seconds, runner CPU seconds) of one stage."""
    strategy = Strategy(dp=4, tp=1, pp=1, mbs=2, gbs=8)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        spec = StageSpec(
            run_dir=run_dir,
            config=config,
            strategy=strategy,
            stage=1,
            workdir=Path(tmp),
            planned_tokens=iters * strategy.gbs * config.model.seq,
            target_iteration=iters,
            save_at_end=False,
        )
        spec_path = spec.write(spec.stage_dir / "spec.json")
        search = None
        if with_search:
            frontier = FrontierSearch(
                config=config, system=load_system("cpu_gloo"), n_gpus=4, dtype="fp32", botorch=True
            )
            search = StageSearch(
                run_dir=run_dir,
                stage=1,
                launched_at=time.time(),
                settings=PolicySettings(base_gbs=8, max_gbs=64, predicted_switch_cost_s=1e12),
                policy_state=initial_state(Candidate(strategy=strategy, predicted_tokens_per_s=1.0)),
                tracker=NoiseScaleTracker(base_batch=8),
                frontier=frontier,
                budget=Budget(total_iters=iters, total_tokens=None, target_ppl=None, seq=config.model.seq),
                noise_scale_floor=1000.0,
                startup_prices_switch=False,
                out=lambda line: None,
            )
            search.start()
        cpu_before = resource.getrusage(resource.RUSAGE_SELF)
        run_stage(spec_path, spec.stage_dir, Topology(nproc_per_node=4, master_port=port), device_type="cpu",
                  quiet=True)  # fmt: skip
        if search is not None:
            search.stop()
        cpu_after = resource.getrusage(resource.RUSAGE_SELF)
        cpu = (cpu_after.ru_utime - cpu_before.ru_utime) + (cpu_after.ru_stime - cpu_before.ru_stime)
        import json

        rows = [json.loads(line) for line in spec.metrics_path.read_text().splitlines()]
        steps = [row["step_time_s"] for row in rows if row.get("step_time_s") is not None][1:]
        return statistics.median(steps), cpu


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--iters", type=int, default=60)
    parser.add_argument("--port", type=int, default=29850)
    args = parser.parse_args()
    config = resolve_log_root(load_config(ROOT / "examples" / "tiny" / ".conaconfig", check_data_files=True))
    ratios = []
    for pair in range(args.pairs):
        without, cpu_without = one_run(config, args.iters, with_search=False, port=args.port + 2 * pair)
        with_, cpu_with = one_run(config, args.iters, with_search=True, port=args.port + 2 * pair + 1)
        ratios.append(with_ / without)
        print(
            f"pair {pair + 1}: median step {without * 1e3:.1f} ms without, {with_ * 1e3:.1f} ms with the "
            f"search (ratio {with_ / without:.3f}); runner CPU {cpu_without:.2f} s vs {cpu_with:.2f} s",
            flush=True,
        )
    print(f"median ratio with/without over {args.pairs} pairs: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
