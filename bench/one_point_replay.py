"""Predicted / measured of each strategy an online run switched to: as the run predicted it, and as the
current estimator predicts it from the same measurements.

For each stage whose strategy was chosen on a prediction: the tokens/s predicted when it was chosen
(``online_stages.json``) over the mean of its stage's steady lines (the summary's,
``cona.runner.views.online_report.stage_rows``), and the same for a replay: the current code's online
frontier (``FrontierSearch``: the run's config, profile and step forms) fed the rates the run had measured
when it made that choice (``decisions.jsonl``), predicting the chosen strategy; then the raw model's host
floor and device time of every stage's strategy. ``--steady`` feeds it the
earlier stages' steady means instead: where a run decided on a line that still held warm-up, what it would
have predicted from the rate those stages went on to show. Runs on a CPU in seconds,
on the run files a device call brought back::

    PYTHONPATH=src .venv/bin/python bench/one_point_replay.py WORK/online/logs/online --system h200_141g
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from cona.engine.spec import StageSpec
from cona.planner.systems import load_system
from cona.runner.schedules.frontier import FrontierSearch
from cona.runner.state import load_state
from cona.runner.views.online_report import stage_rows
from cona.strategy import Strategy


def rates_at_decisions(run_dir: Path) -> dict[int, dict[int, float]]:
    """Per stage that a decision left: the measured tokens/s of every stage so far as the run had them at
    that decision (each stage's last ``current.measured_tokens_per_s`` in ``decisions.jsonl``; a rate the
    run had only predicted, ``rate_measured`` false, is no measurement)."""
    known: dict[int, float] = {}
    at_switch: dict[int, dict[int, float]] = {}
    for line in (run_dir / "decisions.jsonl").read_text().splitlines():
        decision = json.loads(line)
        current = decision.get("current") or {}
        rate = current.get("measured_tokens_per_s")
        if rate and current.get("rate_measured", True):
            known[decision["stage"]] = float(rate)
        if decision["decision"] in ("switch", "fallback"):
            at_switch[decision["stage"]] = dict(known)
    return at_switch


def replayed(run_dir: Path, system: str, *, steady: bool = False) -> list[dict[str, Any]]:
    """Per stage chosen on a prediction: its strategy, the run's predicted / measured and the replay's (the
    current frontier fed the rates the run had measured when it chose the stage; ``steady``: each earlier
    stage's steady mean instead, as the summary gives it)."""
    stages = json.loads((run_dir / "online_stages.json").read_text())
    rows = stage_rows(run_dir, load_state(run_dir), stages)
    config = StageSpec.read(run_dir / "stages" / "1" / "spec.json").config
    at_switch = rates_at_decisions(run_dir)
    if steady:
        means = {row["stage"]: row["tokens_per_s"] for row in rows if row["tokens_per_s"]}
        at_switch = {stage: {s: means[s] for s in rates if s in means} for stage, rates in at_switch.items()}
    out = []
    for row in rows:
        stage, measured, chosen_in = stages[row["stage"] - 1], row["tokens_per_s"], row["stage"] - 1
        if stage["throughput_source"] != "predicted" or not measured or chosen_in not in at_switch:
            continue
        frontier = FrontierSearch(
            config=config, system=load_system(system), n_gpus=1, dtype=config.training.dtype
        )
        for earlier, rate in at_switch[chosen_in].items():
            frontier.add_measurement(
                Strategy(**stages[earlier - 1]["strategy"]), rate, source=f"stage {earlier}"
            )
        strategy = Strategy(**stage["strategy"])
        out.append({
            "stage": row["stage"], "strategy": row["strategy"], "trial": stage.get("trial", False),
            "run": stage["predicted_tokens_per_s"] / measured,
            "replay": frontier.predicted_tokens_per_s(strategy) / measured,
        })  # fmt: skip
    return out


def model_steps(run_dir: Path, system: str) -> list[str]:
    """The raw model's host floor and device time of each stage's strategy (the parts the fit corrects)."""
    stages = json.loads((run_dir / "online_stages.json").read_text())
    config = StageSpec.read(run_dir / "stages" / "1" / "spec.json").config
    frontier = FrontierSearch(
        config=config, system=load_system(system), n_gpus=1, dtype=config.training.dtype
    )
    lines = []
    for index, stage in enumerate(stages, start=1):
        parts = frontier.model_step(Strategy(**stage["strategy"]))
        host_ms, device_ms = 1e3 * float(parts.host_s[0]), 1e3 * float(parts.device_s[0])
        lines.append(f"  stage {index} model: host {host_ms:.1f} ms, device {device_ms:.1f} ms")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", nargs="+", type=Path, help="online runs' log directories")
    parser.add_argument("--system", default="h200_141g", help="the system the runs ran on")
    parser.add_argument(
        "--steady",
        action="store_true",
        help="feed the earlier stages' steady means, not the rates decided on",
    )
    args = parser.parse_args()
    for run_dir in args.run_dirs:
        print(f"{run_dir}: predicted / measured, the run's and replayed")
        for row in replayed(run_dir, args.system, steady=args.steady):
            trial = " (trial)" if row["trial"] else ""
            ratios = f"run {row['run']:.3f}, replay {row['replay']:.3f}"
            print(f"  stage {row['stage']} {row['strategy']}{trial}: {ratios}")
        print("\n".join(model_steps(run_dir, args.system)))


if __name__ == "__main__":
    main()
