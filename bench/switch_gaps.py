"""A gbs-only switch in place against the layout switch of the same CPU chain.

One chain of the shipped tiny example (``examples/tiny/.conaconfig`` on the demo data, 2 CPU processes):
stage 1 dp2 gbs G, stage 2 dp2 gbs 2G (only the batch changes), stage 3 tp2 gbs 2G (the layout changes).
Each round runs it twice as ``cona train --chain`` subprocesses, once with ``--switch-in-place`` (stage 2
continues stage 1 in the workers' memory) and once without (every switch goes through a checkpoint), in
alternating order so a slow period of the machine falls on both. A switch's *gap* is what the runner records
in ``runner_state.json`` for it without the first step at the new shape, which every switch pays: save,
publish, process start, load and verification for a checkpointed switch, the hand-over for one in place.
It prints each run's gaps and the whole command's wall time, then the medians and the ratio of the in-place
gap to the layout switch's gap of the same runs::

    bash scripts/install.sh   # the demo data
    .venv/bin/python bench/switch_gaps.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "tiny" / ".conaconfig"
MODES = {"in place": ("--switch-in-place",), "checkpointed": ()}


def main() -> None:
    args = parse_args()
    if not (ROOT / "data" / "demo" / "tiny-vocab.json").is_file():
        sys.exit("bench/switch_gaps.py: data/demo is missing; run bash scripts/install.sh first")
    work = Path(tempfile.mkdtemp(prefix="cona-gaps-", dir=args.workdir))
    chain = work / "chain.json"
    chain.write_text(json.dumps(three_stage_chain(args.gbs, args.iters)))
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for round_number in range(args.rounds):
        order = list(MODES) if round_number % 2 == 0 else list(reversed(MODES))
        for mode in order:
            gaps = run_chain_once(chain, work / f"{mode.replace(' ', '-')}-{round_number}", MODES[mode])
            runs[mode].append(gaps)
            print(f"round {round_number + 1} {mode}: " + ", ".join(f"{k} {v:.3f} s" for k, v in gaps.items()))
    print_summary(runs)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(runs, indent=1))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="runs of each mode")
    parser.add_argument("--gbs", type=int, default=8, help="stage 1's global batch; stages 2 and 3 double it")
    parser.add_argument("--iters", type=int, default=6, help="iterations of each stage")
    parser.add_argument("--workdir", type=Path, default=None, help="parent of the temporary directory")
    parser.add_argument("--json-out", default=None, help="also write each run's gaps to this JSON file")
    return parser.parse_args()


def three_stage_chain(gbs: int, iters: int) -> dict:
    """dp2 at gbs -> dp2 at 2 gbs (the same layout) -> tp2 at 2 gbs (another layout)."""
    mbs = gbs // 2
    return {
        "steps": [
            {"step_num": 1, "dp": 2, "tp": 1, "pp": 1, "gbs": gbs, "mbs": mbs, "train_iters": iters,
             "is_initial": True, "convert": True},
            {"step_num": 2, "dp": 2, "tp": 1, "pp": 1, "gbs": 2 * gbs, "mbs": mbs, "extra_iters": iters,
             "convert": True},
            {"step_num": 3, "dp": 1, "tp": 2, "pp": 1, "gbs": 2 * gbs, "mbs": mbs, "extra_iters": iters},
        ]
    }  # fmt: skip


def run_chain_once(chain: Path, workdir: Path, flags: tuple[str, ...]) -> dict[str, float]:
    """One ``cona train --chain`` run; returns the gap of each switch, the first steps after them and the
    command's wall time."""
    workdir.mkdir(parents=True)
    command = [
        sys.executable, "-m", "cona", "train", "--chain", str(chain), "--config", str(CONFIG),
        "--gpus", "2", "--workdir", str(workdir), "--run-name", "gaps", "--quiet",
        "--set", f"training.log_root={workdir / 'logs'}", *flags,
    ]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])),
    }
    began = time.perf_counter()
    done = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True)
    wall_s = time.perf_counter() - began
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    state = json.loads((workdir / "logs" / "gaps" / "runner_state.json").read_text())
    gaps = {}
    for stage in state["stages"][1:]:
        cost = stage["switch_cost"]
        name = f"{stage['step_num'] - 1}->{stage['step_num']}"
        gaps[f"gap {name}"] = sum(value for key, value in cost.items() if key != "first_step_s")
        gaps[f"first step {name}"] = cost.get("first_step_s", 0.0)
    gaps["whole run"] = wall_s
    return gaps


def print_summary(runs: dict[str, list[dict[str, float]]]) -> None:
    keys = list(next(iter(runs.values()))[0])
    print("\n| mode | " + " | ".join(keys) + " |")
    print("|---|" + "---:|" * len(keys))
    for mode, rows in runs.items():
        medians = [statistics.median(row[key] for row in rows) for key in keys]
        print(f"| {mode} (median of {len(rows)}) | " + " | ".join(f"{m:.3f} s" for m in medians) + " |")
    in_place = [row["gap 1->2"] / row["gap 2->3"] for row in runs["in place"]]
    checkpointed = [row["gap 1->2"] / row["gap 2->3"] for row in runs["checkpointed"]]
    for mode, ratios in (("in place", in_place), ("checkpointed", checkpointed)):
        listed = ", ".join(f"{ratio:.3f}" for ratio in ratios)
        median = statistics.median(ratios)
        print(f"gbs-only gap / layout gap of the same run, {mode}: {listed} (median {median:.3f})")


if __name__ == "__main__":
    main()
