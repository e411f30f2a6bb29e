"""Time to a target eval perplexity: CONA's online mode against every fixed gbs, a static planner's choice
and a token-milestone ramp, over several seeds.

Every run trains the same GPT from scratch on one corpus (``--corpus bench``: the >= 20M-token corpus that
``bench/corpus.py`` builds; ``bench2``: the check corpus of ``bench/corpus.py --set check``; ``demo``: the
1M-token demo text; ``--data-dir``/``--data-prefix``: any other, e.g. a held-out one) as its own ``cona
train`` subprocess on ``--gpus N`` devices, with the same LR rule, token-based LR schedule, evaluation set
and evaluation spacing (:mod:`ttt.plan`), once per seed of ``--seeds`` (``training.seed``):

* **online**: ``cona train --gpus N --system S --initial-gbs G0 --max-gbs Gmax --target-ppl P
  --total-tokens T`` (it stops itself at the first evaluation with perplexity <= P);
* **fixed-gbsG** for G in G0, 2G0, 4G0, 8G0 (``--fixed-gbs``): a one-step chain (``cona train --chain``,
  which scales the LR to G by the config's rule as online mode does) at the planner's best strategy (layout
  and mbs) for G on N devices. The fixed run at ``--static-gbs`` (default G0) is the static planner's
  choice for a user who gives that gbs;
* **ramp**: the gbs doubles from G0 at each token count of ``--ramp-tokens``, switched in place (``cona
  train --chain --switch-in-place``), in the layout the planner picks for G0: a batch-size ramp at token
  milestones in a fixed layout, as Megatron-LM's and OLMo-core's batch-size schedules run one;
* **online-NAME** (``--online-variant NAME training.KEY=VALUE ...``): online with config keys set (``cona
  train --set``), to compare a policy setting with the defaults in one call, e.g. ``--online-variant
  noprobe training.probe=false`` (switches on the noise-scale model alone, as layout changes are);
* **fixed-gbsG-NAME** (``--fixed-variant NAME G training.KEY=VALUE ...``): a fixed run at G with config keys
  set (e.g. another LR). It is a fixed run: it competes for the best fixed one.

Fixed and chain mode have no perplexity stop, so this script stops them (:mod:`ttt.supervise`). Time to
target is given from the launch (everything counts) and from the run's first training step (start-up apart;
for runs that are not fixed, the runner's start-up beyond the quickest fixed run's is added back), at the
target and at each easier level of the ladder, per seed and as the mean over the seeds, with the tokens
apart (:mod:`ttt.report`); per seed, the hindsight bound of any chain on the same runs
(:mod:`ttt.headroom`). On a GPU a short eager run at G0 comes first and is not reported (``--no-warmup``
leaves it out): the first run on a fresh machine pays for loading the CUDA libraries, which would be
charged to whichever run came first.

The runs can be split over calls (``--runs``, ``--seeds``) and their JSON put together afterwards
(``--merge A.json B.json --out C.json``). GPU, from the repository root, ``data/bench`` carried::

    PYTHONPATH=src python3 bench/time_to_target.py --corpus bench --model 125m --gpus 1 \
        --runs online,fixed-gbs8,fixed-gbs64 --seeds 1234 --out $OUT/ttt-125m-a.json

CPU check of the whole flow (tiny GPT; online, fixed gbs 2 and the ramp; one seed)::

    PYTHONPATH=src .venv/bin/python bench/time_to_target.py --smoke --out /tmp/ttt.json
    PYTHONPATH=src .venv/bin/python bench/time_to_target.py --smoke --gpus 2 --out /tmp/ttt2.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ttt.headroom import format_headroom, work_dir_headroom
from ttt.plan import (
    CORPORA,
    PRESET_OVERRIDES,
    PRESETS,
    PROJECT_ROOT,
    SEEDS,
    Preset,
    fixed_variants,
    online_variants,
    plan_run,
    plan_warmup,
    run_names,
)
from ttt.report import (
    LADDER,
    format_ladder,
    format_seeds_ladder,
    format_table,
    merge_reports,
    seed_dir,
    seeds_summary,
    summarize_run,
)
from ttt.supervise import RunPlan, supervise

END_MARGIN_S = 10.0
"""Budget kept aside per run for the save and exit after its stop."""
COMPARED_FIELDS = ("model", "corpus", "data_prefix", "gpus", "fixed_gbs", "static_gbs", "ramp_tokens",
                   "levels", "patience", "runs", "seeds")  # fmt: skip


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, Preset | None]:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted({m for m, _ in PRESETS}), default="125m")
    parser.add_argument("--corpus", choices=sorted(CORPORA), default="bench")
    parser.add_argument("--smoke", action="store_true", help="the tiny model on CPU processes, demo text")
    parser.add_argument("--gpus", type=int, default=1, help="devices (CPU processes on a CPU) of every run")
    parser.add_argument(
        "--seeds", default=None,
        help=f"comma list of training.seed values (default {','.join(map(str, SEEDS))}; --smoke: {SEEDS[0]})",
    )  # fmt: skip
    parser.add_argument("--data-dir", default=None, help="default: the corpus's folder")
    parser.add_argument("--data-prefix", default=None, help="dataset name in --data-dir (no .bin/.idx)")
    parser.add_argument("--tokenizer-dir", default=None, help="gpt2-vocab.json/merges.txt (default data dir)")
    parser.add_argument("--work-dir", default=None, help="where the runs go (default: a new temp directory)")
    parser.add_argument(
        "--out", type=Path, required=True, help="JSON with the table, written after every run"
    )
    parser.add_argument(
        "--merge", nargs="+", type=Path, default=None, help="only merge these JSON into --out"
    )
    parser.add_argument("--runs", default=None, help="comma list of run names (default: all; see --list)")
    parser.add_argument("--list", action="store_true", help="print the run names and exit")
    for field in PRESET_OVERRIDES:
        kind = type(getattr(PRESETS["125m", "bench"], field))
        parser.add_argument(f"--{field.replace('_', '-')}", type=kind, default=None, help="default: preset's")
    _add_run_flags(parser)
    args = parser.parse_args(argv)
    if args.merge is not None:
        return args, None
    if args.smoke:
        args.model, args.corpus = "tiny", "demo"
    preset = PRESETS.get((args.model, args.corpus))
    if preset is None:
        parser.error(f"--model {args.model} has no preset for --corpus {args.corpus}")
    _resolve(args, preset)
    return args, preset


def _add_run_flags(parser: argparse.ArgumentParser) -> None:
    """The flags that choose the runs, their stops and their variants."""
    parser.add_argument("--fixed-gbs", default=None, help="comma list (default G0, 2G0, 4G0, 8G0)")
    parser.add_argument("--static-gbs", type=int, default=None, help="the static planner's gbs (default G0)")
    parser.add_argument("--ramp-tokens", default=None, help="comma list: the ramp doubles its gbs at each")
    parser.add_argument(
        "--ladder", default=",".join(f"{f:g}" for f in LADDER), help="also time easier levels: P x these"
    )
    parser.add_argument(
        "--min-training-s", type=float, default=40.0, help="main level's least best-fixed time"
    )
    parser.add_argument(
        "--patience", type=int, default=8, help="stop after this many evals without a new best"
    )
    parser.add_argument(
        "--stop-behind", type=float, default=1.3,
        help="cap a fixed or ramp run at this (>= 1) x the best fixed time to target from launch (0: off)",
    )  # fmt: skip
    parser.add_argument(
        "--known-best-s", type=float, default=None,
        help="the best fixed run's time to target from launch in an earlier call (for --stop-behind)",
    )  # fmt: skip
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="torch.compile (its time counts); default on for GPU presets")  # fmt: skip
    parser.add_argument(
        "--botorch", action="store_true", help="online search by BoTorch (default exhaustive)"
    )
    parser.add_argument(
        "--online-variant", action="append", nargs="+", metavar="NAME SECTION.KEY=VALUE",
        help="also run online-NAME: online mode with these config keys set (repeatable)",
    )  # fmt: skip
    parser.add_argument(
        "--fixed-variant", action="append", nargs="+", metavar="NAME GBS SECTION.KEY=VALUE",
        help="also run fixed-gbsGBS-NAME: a fixed run at GBS with these config keys set (repeatable)",
    )  # fmt: skip
    parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                        help="a short eager run first, unreported (default on for GPU presets)")  # fmt: skip


CARD_SYSTEMS = {"H200": "h200_141g", "H100": "h100_80g", "A100": "a100_80g"}
"""The system file of a card whose name holds the key: the planner predicts for the card the runs train on,
not the one the preset names."""


def _card_system() -> str | None:
    """The system of the GPU this runs on (None: no GPU, or one without a file: the preset's then)."""
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0)
    system = next((file for key, file in CARD_SYSTEMS.items() if key in name), None)
    print(f"time_to_target: {name}: system {system or 'of the preset'}", flush=True)
    return system


def _resolve(args: argparse.Namespace, preset: Preset) -> None:
    """Fills what the flags left to the preset and checks what they gave."""
    if args.system is None and preset.device == "cuda":
        args.system = _card_system()
    for field in PRESET_OVERRIDES:
        if getattr(args, field) is None:
            setattr(args, field, getattr(preset, field))
    folder, prefix = CORPORA[args.corpus]
    args.data_dir = args.data_dir or str(PROJECT_ROOT / folder)
    args.data_prefix = args.data_prefix or prefix
    args.tokenizer_dir = args.tokenizer_dir or args.data_dir
    for path in (
        Path(args.data_dir) / f"{args.data_prefix}.bin",
        Path(args.tokenizer_dir) / "gpt2-vocab.json",
    ):
        if not path.is_file():
            flag = "--tokenizer-dir" if path.name.startswith("gpt2") else "--data-dir/--data-prefix"
            raise SystemExit(f"time_to_target: {flag}: {path} does not exist (bench corpus: bench/corpus.py)")
    args.compile = preset.device == "cuda" if args.compile is None else args.compile
    args.warmup = preset.device == "cuda" if args.warmup is None else args.warmup
    _resolve_runs(args, preset)
    try:
        args.levels = [args.target_ppl * float(f) for f in ("1", *args.ladder.split(","))]
    except ValueError:
        raise SystemExit(f"--ladder: {args.ladder!r} is not a comma list of numbers") from None
    if 0 < args.stop_behind < 1:
        raise SystemExit(
            f"--stop-behind: {args.stop_behind:g} would stop a fixed run that can still beat the best "
            "fixed run so far; give 0 (off) or at least 1"
        )
    names = run_names(args)
    default = ["online", f"fixed-gbs{args.initial_gbs}", "ramp"] if args.smoke else names
    args.runs = [r.strip() for r in args.runs.split(",")] if args.runs else default
    unknown = [r for r in args.runs if r not in names]
    if unknown:
        raise SystemExit(f"--runs: unknown {', '.join(unknown)} (choose from {', '.join(names)})")


def _resolve_runs(args: argparse.Namespace, preset: Preset) -> None:
    """The seeds, the fixed gbs sweep (the static planner's gbs in it), the ramp and the variants."""
    if args.gpus < 1:
        raise SystemExit(f"--gpus: {args.gpus} (give at least 1)")
    args.seeds = _int_list("--seeds", args.seeds) or list(SEEDS[:1] if args.smoke else SEEDS)
    args.static_gbs = args.static_gbs or args.initial_gbs
    sweep = _int_list("--fixed-gbs", args.fixed_gbs) or [args.initial_gbs * 2**k for k in range(4)]
    args.fixed_gbs = sorted({*sweep, args.static_gbs})
    args.ramp_tokens = _int_list("--ramp-tokens", args.ramp_tokens) or list(preset.ramp_tokens)
    top = args.initial_gbs * 2 ** len(args.ramp_tokens)
    if args.max_gbs % top:
        raise SystemExit(
            f"--ramp-tokens: {len(args.ramp_tokens)} doublings from --initial-gbs {args.initial_gbs} reach "
            f"gbs {top}, which does not divide --max-gbs {args.max_gbs} (the evaluation set would differ)"
        )
    args.online_variants = online_variants(args.online_variant)
    args.fixed_variants = fixed_variants(args.fixed_variant)


def _int_list(flag: str, text: str | None) -> list[int]:
    if not text:
        return []
    try:
        return sorted({int(value) for value in text.split(",")})
    except ValueError:
        raise SystemExit(f"{flag}: {text!r} is not a comma list of integers") from None


def settings(args: argparse.Namespace, preset: Preset, plans: list[tuple[int, RunPlan]]) -> dict[str, Any]:
    keys = (*PRESET_OVERRIDES, "data_dir", "tokenizer_dir", "compile", "warmup", "botorch", "min_training_s",
            "stop_behind", "known_best_s", "online_variants", "fixed_variants")  # fmt: skip
    return {
        **{key: getattr(args, key) for key in (*keys, *COMPARED_FIELDS)},
        "seq": preset.model["seq"],
        "preset": dataclasses.asdict(preset),
        "commands": {f"{plan.name} seed {seed}": plan.command[1:] for seed, plan in plans},
    }


def write_report(out: Path, report: dict[str, Any]) -> None:
    """The summary over the rows (per seed and the mean over seeds) into ``report``, the JSON to ``out``, and
    the tables to stdout."""
    levels = [f"{level:g}" for level in report["settings"]["levels"]]
    result = seeds_summary(report["runs"], levels, report["settings"].get("min_training_s", 40.0))
    report["summary"] = result
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(format_table(report["runs"], report["settings"]["target_ppl"]), flush=True)
    for seed, by_seed in result["by_seed"].items():
        print(f"seed {seed}:\n{format_ladder(by_seed['ladder'])}", flush=True)
    for seed, bound in sorted(report.get("headroom", {}).items()):
        print(format_headroom(seed, bound), flush=True)
    print(format_seeds_ladder(result["ladder"], result["seeds"]), flush=True)


def headline(report: dict[str, Any]) -> dict[str, Any]:
    """The main level over the seeds and every run's mean time there over the best fixed run's."""
    result = report.get("summary", {})
    level = result.get("main_level")
    entry = result.get("ladder", {}).get(level, {}) if level is not None else {}
    return {"seeds": result.get("seeds"), "main_level": level, "best_fixed": entry.get("best_fixed"),
            "over_best_fixed": entry.get("over_best_fixed")}  # fmt: skip


def merge_main(args: argparse.Namespace) -> int:
    try:
        reports = [(str(path), json.loads(path.read_text())) for path in args.merge]
        merged = merge_reports(reports)
    except (OSError, json.JSONDecodeError, KeyError, ValueError) as err:
        print(f"time_to_target: --merge: {err}", file=sys.stderr)
        return 1
    write_report(args.out, merged)
    print(json.dumps(headline(merged)), flush=True)
    return 0


def run_cap(
    plan: RunPlan, to_come: list[RunPlan], *, left_s: float, best_fixed_s: float | None, stop_behind: float
) -> float:
    """A run's time cap: what is left of the budget, shared in proportion to the caps of the runs still to
    come (less a save's time); for a fixed or ramp run at most ``stop_behind`` x the best fixed run's time
    to target so far. A run still short of the target then can be neither the best fixed run nor a ramp
    that beats it: its ladder up to there is all it has to give."""
    cap = min(plan.cap_s, left_s * plan.cap_s / sum(p.cap_s for p in to_come) - END_MARGIN_S)
    if plan.kind != "online" and best_fixed_s is not None and stop_behind > 0:
        cap = min(cap, stop_behind * best_fixed_s)
    return cap


def settle(plan: RunPlan) -> None:
    """Drop the run's checkpoints (nothing here reads them) and flush what is still being written. A run
    stopped at the target saves its model and optimizer (~1.5 GB at GPT-125M) as it exits; a next run that
    started beside that write-back would be charged seconds of start-up that are not its own."""
    shutil.rmtree(plan.root / "checkpoints", ignore_errors=True)
    os.sync()


def warm_up(plan: RunPlan) -> float:
    """Run ``plan`` to its end (or its cap) and return its wall time; its files stay in its folder."""
    print(f"time_to_target: warm-up (not reported): {' '.join(plan.command[1:])}", flush=True)
    supervised = supervise(plan, target_ppl=0.0, patience=10**9, cap_s=plan.cap_s)
    settle(plan)
    return round(supervised.ended_at - supervised.launched_at, 1)


def main(argv: list[str] | None = None) -> int:
    args, preset = parse_args(argv)
    if preset is None:
        return merge_main(args)
    if args.list:
        print("\n".join(run_names(args)))
        return 0
    # A SIGTERM (a time limit) unwinds through supervise(), which then stops the run it is watching.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="cona-ttt-")).resolve()
    print(
        f"time_to_target: {preset.model} on {args.data_dir}/{args.data_prefix}, {args.gpus} device(s); "
        f"P={args.target_ppl:g}; runs {','.join(args.runs)}; seeds {','.join(map(str, args.seeds))}; "
        f"compile {args.compile}; budget {args.budget_s:.0f} s; in {work}",
        flush=True,
    )
    plans = [(seed, plan_run(name, preset, args, seed_dir(work, seed), seed=seed))
             for seed in args.seeds for name in args.runs]  # fmt: skip
    report: dict[str, Any] = {"settings": settings(args, preset, plans), "runs": [], "headroom": {}}
    if args.warmup:
        report["settings"]["warmup_s"] = warm_up(plan_warmup(preset, args, work))
    started = time.time()  # the budget is the measured runs'
    best_fixed_s = dict.fromkeys(args.seeds, args.known_best_s)
    for index, (seed, plan) in enumerate(plans):
        left = args.budget_s - (time.time() - started)
        to_come = [p for _, p in plans[index:]]
        cap = run_cap(
            plan, to_come, left_s=left, best_fixed_s=best_fixed_s[seed], stop_behind=args.stop_behind
        )
        if cap < 10.0:
            print(
                f"time_to_target: {plan.name} (seed {seed}) skipped, {left:.0f} s of the budget left",
                flush=True,
            )
            continue
        share = run_cap(plan, to_come, left_s=left, best_fixed_s=None, stop_behind=0.0)
        cut = f", cut from {plan.cap_s:.0f} s to fit --budget-s" if share < plan.cap_s - 1.0 else ""
        if plan.kind == "online" and best_fixed_s[seed] is not None and cap < best_fixed_s[seed]:
            cut += f"; under the best fixed run's {best_fixed_s[seed]:.0f} s: it can show a lead, not a loss"
        print(f"time_to_target: {plan.name} seed {seed} (cap {cap:.0f} s{cut}): {' '.join(plan.command[1:])}")
        row = measured_row(plan, seed, cap, args, preset)
        report["runs"].append(row)
        if plan.kind == "fixed" and row["time_to_target_s"] is not None:
            best_fixed_s[seed] = min(row["time_to_target_s"], best_fixed_s[seed] or math.inf)
        bound = work_dir_headroom(seed_dir(work, seed), args.target_ppl)
        if bound is not None:
            report["headroom"][str(seed)] = bound
        write_report(args.out, report)
    print(json.dumps(headline(report)), flush=True)
    print(f"time_to_target: done in {time.time() - started:.0f} s; JSON {args.out}", flush=True)
    return 0


def measured_row(
    plan: RunPlan, seed: int, cap: float, args: argparse.Namespace, preset: Preset
) -> dict[str, Any]:
    """Run one plan under its cap and read its row back (its log's tail printed where it failed)."""
    supervised = supervise(plan, target_ppl=args.target_ppl, patience=args.patience, cap_s=cap)
    settle(plan)
    if supervised.exit_code not in (0, None) and supervised.stop == "exited":
        print((plan.root / "cona.log").read_text()[-3000:], flush=True)
    return summarize_run(
        name=plan.name, kind=plan.kind, seed=seed, run_dir=plan.run_dir, supervised=supervised,
        target_ppl=args.target_ppl, levels=args.levels, seq=preset.model["seq"],
    )  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
