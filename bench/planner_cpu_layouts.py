"""CPU tiny-model layouts: measured throughput against the planner's ``cpu_gloo`` prediction, before and
after calibration, with the calibration fitted on some layouts and judged on the others.

    .venv/bin/python bench/planner_cpu_layouts.py --json-out /tmp/cpu_layouts.json
    .venv/bin/python bench/planner_cpu_layouts.py --from-json /tmp/cpu_layouts.json [more.json]  # table only

Each layout trains the model of ``examples/tiny/.conaconfig`` (gloo, CPU, ``cona train`` with a fixed
strategy) for ``--iters`` iterations, logging every ``--log-interval``; a run's step time is the median of its
logged intervals without the first (start-up), as ``measurements_from_metrics`` reads it for calibration.
Layouts run round-robin, ``--repeats`` times each, so a slow period of a shared machine spreads over all of
them; the measured step is the median over the repeats.

``cpu_gloo`` describes one CPU core per rank. The launcher gives each rank ``cores / ranks`` threads, so a
run is pinned (CPU affinity) to ``min(ranks, cores)`` cores: a one-process layout gets one core, not the whole
machine. Layouts with more ranks than cores are oversubscribed; the table says so.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from cona.config import PATH_KEYS
from cona.config.file import load_config
from cona.planner.calibration import measurements_from_metrics
from cona.planner.step_parts import model_step_parts
from cona.planner.step_shape import StepShape, fit_shape
from cona.planner.systems import load_system
from cona.strategy import Strategy

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_CONFIG = ROOT / "examples" / "tiny" / ".conaconfig"
SYSTEM = "cpu_gloo"


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    name: str
    dp: int
    tp: int
    pp: int
    mbs: int
    gbs: int
    fit: bool
    """Calibrated on (True) or held out to judge the calibration (False)."""

    @property
    def ranks(self) -> int:
        return self.dp * self.tp * self.pp


# The fitted subset covers compute (dp1), data-parallel gradient traffic (dp2), tensor-parallel all-reduces
# (tp2) and pipeline sends and bubble (pp2), all at mbs 2; the held-out rows change the micro-batch size
# (per-micro-batch overhead against matmul efficiency) and the degree.
LAYOUTS = (
    Layout(name="dp1 mbs2", dp=1, tp=1, pp=1, mbs=2, gbs=8, fit=True),
    Layout(name="dp2 mbs2", dp=2, tp=1, pp=1, mbs=2, gbs=8, fit=True),
    Layout(name="tp2 mbs2", dp=1, tp=2, pp=1, mbs=2, gbs=8, fit=True),
    Layout(name="pp2 mbs2", dp=1, tp=1, pp=2, mbs=2, gbs=8, fit=True),
    Layout(name="dp1 mbs1", dp=1, tp=1, pp=1, mbs=1, gbs=8, fit=False),
    Layout(name="dp1 mbs4", dp=1, tp=1, pp=1, mbs=4, gbs=8, fit=False),
    Layout(name="dp2 mbs4", dp=2, tp=1, pp=1, mbs=4, gbs=8, fit=False),
    Layout(name="tp2 mbs4", dp=1, tp=2, pp=1, mbs=4, gbs=8, fit=False),
    Layout(name="dp4 mbs2", dp=4, tp=1, pp=1, mbs=2, gbs=8, fit=False),
)


def write_bench_config(directory: Path, log_interval: int) -> Path:
    """The example config with absolute data paths and runs logged under ``directory``."""
    raw = json.loads(EXAMPLE_CONFIG.read_text())
    training = raw.setdefault("training", {})
    for key in PATH_KEYS:
        if isinstance(training.get(key), str):
            training[key] = str((EXAMPLE_CONFIG.parent / training[key]).resolve())
    training["log_root"] = str(directory / "logs")
    training["log_interval"] = log_interval
    training["eval_interval"] = 10**6  # no evaluation inside the timed steps
    training["wandb_mode"] = "disabled"
    path = directory / ".conaconfig"
    path.write_text(json.dumps(raw, indent=2))
    return path


def free_port() -> int:
    """A port nobody listens on now (other jobs on the machine use torchrun's default)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def pinned_cores(ranks: int) -> set[int]:
    """The first ``min(ranks, cores)`` cores this process may use."""
    cores = sorted(os.sched_getaffinity(0))
    return set(cores[: min(ranks, len(cores))])


def run_layout(layout: Layout, config: Path, directory: Path, run_name: str, iters: int) -> float:
    """Train ``layout`` once and return its median step seconds (first logged interval dropped)."""
    command = [
        sys.executable, "-m", "cona", "train", "--config", str(config),
        "--dp", str(layout.dp), "--tp", str(layout.tp), "--pp", str(layout.pp),
        "--mbs", str(layout.mbs), "--gbs", str(layout.gbs), "--iters", str(iters),
        "--workdir", str(directory / "work" / run_name), "--run-name", run_name, "--quiet",
        "--master-port-base", str(free_port() - 1),  # stage 1 rendezvous on BASE + 1
    ]  # fmt: skip
    cores = pinned_cores(layout.ranks)
    done = subprocess.run(
        command, capture_output=True, text=True, preexec_fn=lambda: os.sched_setaffinity(0, cores)
    )
    if done.returncode != 0:
        raise SystemExit(f"{layout.name}: cona train failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    metrics = directory / "logs" / run_name / "metrics.jsonl"
    measured = measurements_from_metrics(metrics, training=load_config(config).training)
    if len(measured) != 1:
        raise SystemExit(f"{layout.name}: expected one strategy in the run's metrics, got {len(measured)}")
    return measured[0][1]


def measure(
    layouts: tuple[Layout, ...],
    repeats: int,
    iters: int,
    log_interval: int,
    root: Path,
    progress: Path | None,
) -> dict:
    """Round-robin runs of every layout; step seconds of each run, in order (also written to ``progress``
    after every run, so an interrupted measurement can still be tabulated)."""
    config = write_bench_config(root, log_interval)
    steps: dict[str, list[float]] = {layout.name: [] for layout in layouts}
    loads: list[float] = []
    results = {
        "layouts": [asdict(layout) for layout in layouts],
        "step_s": steps,
        "load_average": loads,
        "iters": iters,
        "log_interval": log_interval,
        "cores": len(os.sched_getaffinity(0)),
    }
    for repeat in range(repeats):
        for layout in layouts:
            started = time.perf_counter()
            name = f"{layout.name.replace(' ', '-')}-r{repeat}"
            steps[layout.name].append(run_layout(layout, config, root, name, iters))
            loads.append(os.getloadavg()[0])
            print(
                f"{layout.name:9} repeat {repeat}: {steps[layout.name][-1]:.3f} s/step "
                f"(run {time.perf_counter() - started:.0f} s, load {loads[-1]:.1f})",
                flush=True,
            )
            if progress is not None:
                progress.write_text(json.dumps(results, indent=2))
    return results


def strategy_of(layout: Layout, training) -> Strategy:
    return Strategy(
        dp=layout.dp,
        tp=layout.tp,
        pp=layout.pp,
        mbs=layout.mbs,
        gbs=layout.gbs,
        zero_stage=training.runtime.zero_stage,
        recompute=training.runtime.recompute,
        sequence_parallel=training.runtime.sequence_parallel,
        pipeline_schedule=training.runtime.pipeline_schedule,
        virtual_stages=training.runtime.pipeline_virtual_stages,
    )


def tabulate(results: dict, statistic: str = "median") -> dict:
    """Print the Markdown table and return the summary numbers; a layout's step time is the median of its
    runs, or with ``statistic="min"`` its fastest run (the one other jobs disturbed least)."""
    pick = min if statistic == "min" else statistics.median
    config = load_config(EXAMPLE_CONFIG)
    model, training = config.model, config.training
    system = load_system(SYSTEM)
    # An interrupted measurement: tabulate the layouts that ran at least once.
    layouts = [Layout(**row) for row in results["layouts"] if results["step_s"][row["name"]]]
    measured = {layout.name: pick(results["step_s"][layout.name]) for layout in layouts}
    strategies = {layout.name: strategy_of(layout, training) for layout in layouts}
    parts = model_step_parts(
        model, [strategies[layout.name] for layout in layouts], system, training.runtime.dtype
    )
    fitted_on = [row for row, layout in enumerate(layouts) if layout.fit]
    # The runtime's calibration (what cona plan and the online search fit on measured steps).
    calibration = fit_shape(parts.take(fitted_on), [measured[layouts[row].name] for row in fitted_on])
    tokens = {layout.name: layout.gbs * model.seq for layout in layouts}
    cores = results["cores"]
    print("| layout | ranks | role | measured tokens/s (runs) | predicted before | error | after | error |")
    print("|---|---:|---|---|---:|---:|---:|---:|")
    errors: dict[str, dict[str, list[float]]] = {"fit": {}, "held-out": {}}
    for row, layout in enumerate(layouts):
        role = "fit" if layout.fit else "held-out"
        runs = ", ".join(f"{tokens[layout.name] / s:.0f}" for s in results["step_s"][layout.name])
        measured_tps = tokens[layout.name] / measured[layout.name]
        cells = []
        for key, fitted in (("before", StepShape()), ("after", calibration)):
            seconds = float(fitted.step_s(parts.take(row))[0])
            predicted_tps = tokens[layout.name] / seconds
            error = predicted_tps / measured_tps - 1
            errors[role].setdefault(key, []).append(error)
            cells.append(f"{predicted_tps:.0f} | {error:+.1%}")
        crowded = " (oversubscribed)" if layout.ranks > cores else ""
        print(
            f"| {layout.name} | {layout.ranks}{crowded} | {role} | {measured_tps:.0f} ({runs}) | "
            f"{' | '.join(cells)} |"
        )
    summary = {
        f"{role} {key}": {
            "mean_abs": float(np.mean(np.abs(values))),
            "max_abs": float(np.max(np.abs(values))),
        }
        for role, by_key in errors.items()
        for key, values in by_key.items()
    }
    print()
    for label, numbers in summary.items():
        print(f"{label}: mean |error| {numbers['mean_abs']:.1%}, max {numbers['max_abs']:.1%}")
    fit_names = ", ".join(layout.name for layout in layouts if layout.fit)
    print(f"fitted on {fit_names}: {calibration.describe()}")
    loads = results["load_average"]
    print(
        f"1-minute load average after each run: min {min(loads):.1f}, median {statistics.median(loads):.1f}, "
        f"max {max(loads):.1f}; {cores} cores"
    )
    return summary


def pooled(measurements: list[dict]) -> dict:
    """Several measurement files as one: each layout's runs and the load averages concatenated."""
    first = measurements[0]
    layouts = {row["name"]: row for part in measurements for row in part["layouts"]}
    return {
        **first,
        "layouts": list(layouts.values()),
        "step_s": {
            name: [s for part in measurements for s in part["step_s"].get(name, [])] for name in layouts
        },
        "load_average": [load for part in measurements for load in part["load_average"]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="runs per layout (default 2)")
    parser.add_argument("--iters", type=int, default=8, help="iterations per run (default 8)")
    parser.add_argument("--log-interval", type=int, default=2, help="iterations per logged interval")
    parser.add_argument("--layouts", nargs="*", help="names of the layouts to run (default all)")
    parser.add_argument("--json-out", help="write the measurements here (re-tabulate with --from-json)")
    parser.add_argument(
        "--from-json", nargs="+", help="tabulate these measurements (their runs pooled) instead of running"
    )
    parser.add_argument(
        "--statistic", choices=("median", "min"), default="median", help="a layout's step over its runs"
    )
    args = parser.parse_args()
    if args.from_json:
        results = pooled([json.loads(Path(path).read_text()) for path in args.from_json])
    else:
        chosen = tuple(layout for layout in LAYOUTS if not args.layouts or layout.name in args.layouts)
        with tempfile.TemporaryDirectory(prefix="cona-cpu-layouts-") as scratch:
            progress = Path(args.json_out) if args.json_out else None
            results = measure(chosen, args.repeats, args.iters, args.log_interval, Path(scratch), progress)
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(results, indent=2))
    results["summary"] = tabulate(results, args.statistic)
    if args.json_out and not args.from_json:
        Path(args.json_out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
