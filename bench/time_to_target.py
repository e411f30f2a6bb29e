"""Time to a target eval perplexity: CONA's online mode against fixed strategies, in one call.

Every run trains the same GPT from scratch on the demo text (``data/demo``) as its own ``cona train``
subprocess, with the same seed, LR rule, token-based LR schedule, evaluation set and evaluation spacing:

* **online**: ``cona train --gpus 1 --system S --initial-gbs G0 --max-gbs Gmax --target-ppl P
  --total-tokens T`` (it stops itself at the first evaluation with perplexity <= P);
* **fixed gbs G** for each ``--fixed-gbs``: a one-step chain (``cona train --chain``, which scales the LR to
  G by the config's rule as online mode does) at the strategy the planner finds best for G. Neither fixed
  nor chain mode has a perplexity stop, so this script is the stop rule: at the first evaluation <= P in the
  run's ``metrics.jsonl`` it writes ``switch_request.json`` with action ``stop`` (what online mode's own stop
  writes); the worker saves at the next step and exits, and the chain runner reports the early end.

Time to target = the ``time`` of that evaluation's metrics record minus the moment this script started the
run's process: start-up, the planner, every switch and the evaluations count. Start-up and the online run's
switch gaps are also reported on their own.
Method and choices: docs/benchmarks.md ("Time to a target perplexity").

GPU (one H200), from the repository root::

    PYTHONPATH=src timeout 590 python3 bench/time_to_target.py --out $OUT/ttt.json

CPU check of the whole flow (tiny GPT, one CPU process)::

    PYTHONPATH=src .venv/bin/python bench/time_to_target.py --smoke --out /tmp/ttt.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROJECT_ROOT = Path(__file__).resolve().parents[1]
STOP_GRACE_S = 45.0
"""After a stop request, how long the run may take to save and exit before it is terminated."""
TERM_GRACE_S = 15.0
END_MARGIN_S = 10.0
"""Budget kept aside per run for the save and exit after its stop."""
POLL_S = 0.5


@dataclass(frozen=True, kw_only=True)
class Preset:
    """A model and the knobs that go with it (every one can be overridden by a flag)."""

    model: dict[str, Any]
    base_gbs: int
    base_lr: float
    base_min_lr: float
    device: str
    system: str
    initial_gbs: int
    max_gbs: int
    target_ppl: float
    total_tokens: int
    warmup_tokens: int
    eval_every_tokens: int
    eval_samples: int
    budget_s: float
    online_cap_s: float
    fixed_cap_s: float


PRESET_OVERRIDES = ("system", "initial_gbs", "max_gbs", "target_ppl", "total_tokens", "warmup_tokens",
                    "eval_every_tokens", "budget_s", "online_cap_s", "fixed_cap_s")  # fmt: skip
"""Preset fields that a flag of the same name (``--initial-gbs``) overrides."""

# seq 512: the corpus holds ~1.04 M tokens, i.e. ~1,900 train sequences of 512 (~960 of 1024), so a gbs-64
# step is 1/30 of an epoch and the batch-size trade-off has room before the model starts to overfit.
PRESETS = {
    "125m": Preset(
        model={"name": "gpt-125m", "layers": 12, "hidden": 768, "heads": 12, "seq": 512},
        base_gbs=8, base_lr=4e-4, base_min_lr=4e-5, device="cuda", system="h200_141g",
        initial_gbs=8, max_gbs=64, target_ppl=300.0, total_tokens=8_000_000, warmup_tokens=160_000,
        eval_every_tokens=131_072, eval_samples=64, budget_s=540.0, online_cap_s=200.0, fixed_cap_s=120.0,
    ),
    "tiny": Preset(
        model={"name": "gpt-tiny", "layers": 4, "hidden": 64, "heads": 4, "seq": 128,
               "attention_dropout": 0.0, "hidden_dropout": 0.0},
        base_gbs=2, base_lr=2e-3, base_min_lr=2e-4, device="cpu", system="cpu_gloo",
        initial_gbs=2, max_gbs=8, target_ppl=48_000.0, total_tokens=8_192, warmup_tokens=256,
        eval_every_tokens=512, eval_samples=8, budget_s=420.0, online_cap_s=130.0, fixed_cap_s=110.0,
    ),
}  # fmt: skip


# --- configs and commands ---------------------------------------------------------------------------------


def eval_interval(eval_every_tokens: int, gbs: int, seq: int) -> int:
    """Iterations between evaluations so that one falls every ``eval_every_tokens`` tokens at ``gbs``."""
    return max(1, round(eval_every_tokens / (gbs * seq)))


def eval_samples(preset: Preset, max_gbs: int) -> int:
    """The evaluation set's size: ``preset.eval_samples`` rounded up to a multiple of base_gbs and max_gbs.
    The worker rounds it to whole micro-batches, so every run evaluates the same samples only when each
    micro-batch size divides it (true when the gbs values divide max_gbs, as doubling from G0 gives)."""
    unit = math.lcm(preset.base_gbs, max_gbs)
    return unit * math.ceil(preset.eval_samples / unit)


def conaconfig(preset: Preset, args: argparse.Namespace, *, eval_gbs: int, root: Path) -> dict[str, Any]:
    """The run's .conaconfig: the demo data, a per-run index cache (no run inherits another's), logs here."""
    data = Path(args.data_dir).resolve()
    interval = eval_interval(args.eval_every_tokens, eval_gbs, preset.model["seq"])
    training = {
        "seed": 1234, "device": preset.device, "dtype": "bf16" if preset.device == "cuda" else "fp32",
        "zero_stage": 1, "compile": bool(args.compile), "base_gbs": preset.base_gbs,
        "base_lr": preset.base_lr, "base_min_lr": preset.base_min_lr, "lr_scale_strategy": "sqrt",
        "lr_warmup_tokens": args.warmup_tokens, "lr_decay_tokens": args.total_tokens, "weight_decay": 0.1,
        "split": "949,50,1", "data_prefix": str(data / "wiki_text_document"),
        "vocab_file": str(data / "gpt2-vocab.json"), "merge_file": str(data / "gpt2-merges.txt"),
        "tokenizer_type": "GPT2BPETokenizer", "data_cache_path": str(root / "index-cache"),
        "log_interval": max(1, interval // 4), "eval_interval": interval,
        "eval_iters": eval_samples(preset, args.max_gbs) // preset.base_gbs, "log_root": str(root / "logs"),
        "wandb_mode": "disabled",
    }  # fmt: skip
    return {"model": dict(preset.model), "training": training}


def best_mbs(config_path: Path, system: str, gbs: int) -> int:
    """The micro-batch of the planner's best one-device strategy at ``gbs`` (what online mode would run)."""
    from cona.config import load_config
    from cona.planner.systems import load_system
    from cona.runner.online_search import FrontierSearch
    from cona.runner.stage_run import checkpoint_dtype

    config = load_config(config_path, check_data_files=True)
    loaded = load_system(system)
    dtype = loaded.resolve_dtype(checkpoint_dtype(config.training, config.training.device))
    found = FrontierSearch(config=config, system=loaded, n_gpus=1, dtype=dtype, botorch=False)(gbs)
    if found is None:
        raise SystemExit(f"time_to_target: no one-device strategy fits gbs {gbs} on {system}")
    return found.strategy.mbs


def one_step_chain(gbs: int, mbs: int, iters: int) -> dict[str, Any]:
    step = {"step_num": 1, "dp": 1, "tp": 1, "pp": 1, "gbs": gbs, "mbs": mbs, "train_iters": iters}
    return {"steps": [{**step, "is_initial": True, "convert": False}]}


def free_port_base() -> int:
    """A base port whose stage-1 port (base + 1) is free now; the runs get distinct bases."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1] - 1


@dataclass(frozen=True, kw_only=True)
class RunPlan:
    name: str
    kind: str
    """``online`` or ``fixed``."""
    command: list[str]
    root: Path
    run_dir: Path
    cap_s: float


def plan_runs(preset: Preset, args: argparse.Namespace, work: Path) -> list[RunPlan]:
    seq = preset.model["seq"]
    common = ["--gpus", "1", "--quiet"]
    plans = []
    online_root = work / "online"
    online_root.mkdir(parents=True)
    config = online_root / ".conaconfig"
    config.write_text(json.dumps(conaconfig(preset, args, eval_gbs=args.initial_gbs, root=online_root)))
    online = ["--system", args.system, "--initial-gbs", str(args.initial_gbs), "--max-gbs", str(args.max_gbs)]
    online += ["--target-ppl", f"{args.target_ppl:g}", "--total-tokens", str(args.total_tokens)]
    online += [] if args.botorch else ["--no-botorch"]
    plans.append(_plan("online", "online", online_root, config, [*common, *online], args.online_cap_s))
    # Smallest and largest first: they bound the result if the budget runs out before the middle ones.
    fixed = sorted(args.fixed_gbs)
    for gbs in [fixed[0], fixed[-1], *fixed[1:-1]] if len(fixed) > 1 else fixed:
        root = work / f"fixed-gbs{gbs}"
        root.mkdir(parents=True)
        config = root / ".conaconfig"
        config.write_text(json.dumps(conaconfig(preset, args, eval_gbs=gbs, root=root)))
        mbs = best_mbs(config, args.system, gbs)
        if eval_samples(preset, args.max_gbs) % mbs:
            raise SystemExit(f"time_to_target: mbs {mbs} at gbs {gbs} would change the evaluation set")
        chain = root / "chain.json"
        chain.write_text(json.dumps(one_step_chain(gbs, mbs, math.ceil(args.total_tokens / (gbs * seq)))))
        extra = ["--chain", str(chain), *common]
        plans.append(_plan(f"fixed-gbs{gbs}", "fixed", root, config, extra, args.fixed_cap_s))
    return plans


def _plan(name: str, kind: str, root: Path, config: Path, extra: list[str], cap_s: float) -> RunPlan:
    command = [sys.executable, "-m", "cona", "train", "--config", str(config), "--workdir", str(root)]
    command += ["--run-name", name, "--master-port-base", str(free_port_base()), *extra]
    return RunPlan(
        name=name, kind=kind, command=command, root=root, run_dir=root / "logs" / name, cap_s=cap_s
    )


# --- running one configuration -----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Supervised:
    launched_at: float
    ended_at: float
    exit_code: int | None
    stop: str
    """Why it ended: target, stopped itself, cap, no improvement, exited, terminated."""


def request_stop(run_dir: Path, reason: str) -> None:
    """The switch-request file with action ``stop`` (atomically): workers save at the next step and exit."""
    # A cap can fall before the runner made the directory; the runner then deletes the request when it
    # launches the stage, and the run ends by termination after the grace.
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / ".switch_request.json.tmp"
    tmp.write_text(json.dumps({"action": "stop", "reason": reason}) + "\n")
    os.replace(tmp, run_dir / "switch_request.json")


@dataclass(kw_only=True)
class StopRule:
    """When this script stops a run: a fixed run at the first evaluation at or below the target (an online
    run stops itself there); any run at its time cap, or after ``patience`` evaluations without a new best
    perplexity (on this small corpus a run that starts to overfit before the target never reaches it)."""

    plan: RunPlan
    target_ppl: float
    patience: int
    cap_s: float
    launched: float
    trained: bool = False
    """Whether a metrics line was seen (the first one is printed as the end of the start-up)."""
    best: float = math.inf
    since_best: int = 0
    reason: str | None = None
    requested_at: float | None = None

    def see(self, record: dict[str, Any]) -> None:
        if not self.trained and "step_time_s" in record:
            self.trained = True
            print(
                f"  [{self.plan.name}] first steps done {record['time'] - self.launched:.1f} s after launch"
            )
        ppl = record.get("eval_ppl")
        if ppl is None:
            return
        print(
            f"  [{self.plan.name}] {record['time'] - self.launched:7.1f} s  it {record['iteration']:5d}  "
            f"{record['consumed_tokens']:>11,} tok  gbs {record['gbs']:4d}  eval ppl {ppl:9.1f}",
            flush=True,
        )
        self.best, self.since_best = (ppl, 0) if ppl < self.best else (self.best, self.since_best + 1)
        if self.reason is not None:
            return
        if ppl <= self.target_ppl:
            online = self.plan.kind == "online"
            self._stop("stopped itself" if online else "target", request=not online)
        elif self.since_best >= self.patience:
            self._stop(f"no improvement in {self.patience} evals")

    def overdue(self, now: float) -> bool:
        """Whether the run should be terminated: it did not exit within the grace after the stop."""
        if self.reason is None and now - self.launched > self.cap_s:
            self._stop(f"cap {self.cap_s:.0f} s")
        return self.requested_at is not None and now - self.requested_at > STOP_GRACE_S

    def _stop(self, reason: str, *, request: bool = True) -> None:
        self.reason, self.requested_at = reason, time.time()
        if request:
            request_stop(self.plan.run_dir, reason)


def supervise(plan: RunPlan, *, target_ppl: float, patience: int, cap_s: float) -> Supervised:
    """Run one configuration under its :class:`StopRule`, printing its evaluations as they come."""
    import subprocess

    from cona.runner.jsonl_tail import JsonlTail

    paths = [str(PROJECT_ROOT / "src"), os.environ.get("PYTHONPATH")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths))}
    # A fresh compile cache per run: no run may reuse kernels an earlier run compiled.
    env["TORCHINDUCTOR_CACHE_DIR"] = str(plan.root / "inductor-cache")
    env["TRITON_CACHE_DIR"] = str(plan.root / "triton-cache")
    tail = JsonlTail(plan.run_dir / "metrics.jsonl")
    with open(plan.root / "cona.log", "w") as log:
        launched = time.time()
        process = subprocess.Popen(
            plan.command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        rule = StopRule(plan=plan, target_ppl=target_ppl, patience=patience, cap_s=cap_s, launched=launched)
        try:
            while process.poll() is None:
                time.sleep(POLL_S)
                for record in tail.new_records():
                    rule.see(record)
                if rule.overdue(time.time()):
                    rule.reason = f"{rule.reason}; terminated"
                    _terminate(process)
        finally:  # this script interrupted or killed by its time limit: take the run down with it
            if process.poll() is None:
                _terminate(process)
    for record in tail.new_records():
        rule.see(record)
    return Supervised(
        launched_at=launched, ended_at=time.time(), exit_code=process.returncode, stop=rule.reason or "exited"
    )


def _terminate(process: Any) -> None:
    """SIGTERM to the run's process group (cona and torchrun, which stops its workers), then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        if _group_exits(process, TERM_GRACE_S):
            break
    process.wait()


def _group_exits(process: Any, wait_s: float) -> bool:
    deadline = time.time() + wait_s
    while time.time() < deadline:
        process.poll()  # reaps the leader: a zombie would keep its group alive
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(POLL_S)
    return False


# --- reading a run back ------------------------------------------------------------------------------------


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # the torn last line of a killed writer
        if isinstance(record, dict):
            records.append(record)
    return records


def first_at_or_below(records: list[dict[str, Any]], level: float) -> dict[str, Any] | None:
    return next((r for r in records if r.get("eval_ppl") is not None and r["eval_ppl"] <= level), None)


def step_start(record: dict[str, Any]) -> float:
    """When the steps of a record's log interval began."""
    return float(record["time"]) - float(record["step_time_s"]) * int(record.get("steps_in_interval", 1))


def switch_gaps(records: list[dict[str, Any]]) -> list[float]:
    """Per stage change: the last record of one stage until the first step of the next (save, publish,
    restart, load, first-step warm-up)."""
    gaps = []
    for before, after in zip(records, records[1:], strict=False):
        if after.get("stage") != before.get("stage"):
            gaps.append(step_start(after) - float(before["time"]))
    return gaps


def stage_strategies(records: list[dict[str, Any]]) -> list[str]:
    labels: list[str] = []
    stage = None
    for record in records:
        if record.get("stage") != stage:
            stage = record.get("stage")
            labels.append(f"gbs{record['gbs']}/mbs{record['mbs']}")
    return labels


def summarize_run(
    *,
    name: str,
    kind: str,
    run_dir: Path,
    supervised: Supervised,
    target_ppl: float,
    levels: list[float],
    seq: int,
) -> dict[str, Any]:
    """One table row from the run directory (metrics.jsonl, decisions.jsonl, realized_chain.json)."""
    records = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "time" in r and "step_time_s" in r]
    decisions = read_jsonl(run_dir / "decisions.jsonl")
    realized = run_dir / "realized_chain.json"
    hit = first_at_or_below(records, target_ppl)
    upto = records[: records.index(hit) + 1] if hit is not None else records
    evals = [r for r in upto if r.get("eval_ppl") is not None]
    steps_s = sum(float(r["step_time_s"]) * int(r.get("steps_in_interval", 1)) for r in upto)
    tokens = sum(int(r["gbs"]) * seq * int(r.get("steps_in_interval", 1)) for r in upto)
    all_evals = [r["eval_ppl"] for r in records if r.get("eval_ppl") is not None]
    launched = supervised.launched_at
    ladder = {}
    for level in levels:
        reached = first_at_or_below(records, level)
        ladder[f"{level:g}"] = None if reached is None else round(reached["time"] - launched, 2)
    return {
        "run": name,
        "kind": kind,
        "reached": hit is not None,
        "time_to_target_s": None if hit is None else round(hit["time"] - launched, 2),
        "tokens_to_target": None if hit is None else int(hit["consumed_tokens"]),
        "eval_spacing_s": round(evals[-1]["time"] - evals[-2]["time"], 2) if len(evals) > 1 else None,
        "startup_s": round(step_start(records[0]) - launched, 2) if records else None,
        "switch_gaps_s": [round(gap, 2) for gap in switch_gaps(upto)],
        "training_s": round(steps_s, 2),
        "mean_tokens_per_s": round(tokens / steps_s) if steps_s > 0 else None,
        "stages": stage_strategies(upto),
        "switches": sum(1 for d in decisions if d.get("decision") in ("switch", "fallback")),
        "final_ppl": all_evals[-1] if all_evals else None,
        "best_ppl": min(all_evals) if all_evals else None,
        "realized_chain": json.loads(realized.read_text()) if realized.is_file() else None,
        "wall_s": round(supervised.ended_at - launched, 2),
        "stop": supervised.stop,
        "exit_code": supervised.exit_code,
        "time_to_level_s": ladder,
    }


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Best and worst fixed run by time to target (a run that did not reach it is slower than any that did),
    and the online run's time over each."""
    fixed = [r for r in rows if r["kind"] == "fixed"]
    online = next((r for r in rows if r["kind"] == "online"), None)
    result: dict[str, Any] = {"fixed_tried": [r["run"] for r in fixed]}
    if not fixed:
        return result
    ordered = sorted(fixed, key=lambda r: r["time_to_target_s"] if r["reached"] else math.inf)
    result.update(best_fixed=ordered[0]["run"], worst_fixed=ordered[-1]["run"])
    if online is not None and online["reached"]:
        for label, row in (("best", ordered[0]), ("worst", ordered[-1])):
            if row["reached"]:
                result[f"online_over_{label}_fixed"] = round(
                    online["time_to_target_s"] / row["time_to_target_s"], 3
                )
    return result


def format_table(rows: list[dict[str, Any]], target_ppl: float) -> str:
    def number(value: Any, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    header = (
        f"{'run':<14} {'to P=' + format(target_ppl, 'g') + ' s':>11} {'tokens':>11} {'startup s':>9} "
        f"{'switch gaps s':>14} {'eval every s':>12} {'final ppl':>9} {'tok/s':>9}  stages (switches)"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        ttt = number(row["time_to_target_s"], ".1f") if row["reached"] else f">{row['wall_s']:.0f}"
        gaps = "+".join(f"{gap:.0f}" for gap in row["switch_gaps_s"]) or "-"
        lines.append(
            f"{row['run']:<14} {ttt:>11} {number(row['tokens_to_target'], ','):>11} "
            f"{number(row['startup_s'], '.1f'):>9} {gaps:>14} {number(row['eval_spacing_s'], '.1f'):>12} "
            f"{number(row['final_ppl'], '.1f'):>9} {number(row['mean_tokens_per_s'], ','):>9}  "
            f"{' -> '.join(row['stages']) or '-'} ({row['switches']}); stop: {row['stop']}"
        )
    return "\n".join(lines)


# --- command line ------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, Preset]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(PRESETS), default="125m")
    parser.add_argument(
        "--smoke", action="store_true", help="the tiny model on one CPU process, small budgets"
    )
    parser.add_argument("--data-dir", default=str(PROJECT_ROOT / "data" / "demo"))
    parser.add_argument("--work-dir", default=None, help="where the runs go (default: a new temp directory)")
    parser.add_argument(
        "--out", type=Path, required=True, help="JSON with the table, written after every run"
    )
    for field in PRESET_OVERRIDES:
        kind = type(getattr(PRESETS["125m"], field))
        parser.add_argument(f"--{field.replace('_', '-')}", type=kind, default=None, help="default: preset's")
    parser.add_argument("--fixed-gbs", default=None, help="comma list (default: initial, middle, max gbs)")
    parser.add_argument("--ladder", default="1.25,1.5,2,3", help="also time easier levels: P x these")
    parser.add_argument(
        "--patience", type=int, default=8, help="stop after this many evals without a new best"
    )
    parser.add_argument("--compile", action="store_true", help="torch.compile (its time counts, per stage)")
    parser.add_argument(
        "--botorch", action="store_true", help="online search by BoTorch (default exhaustive)"
    )
    args = parser.parse_args(argv)
    preset = PRESETS["tiny" if args.smoke else args.model]
    for field in PRESET_OVERRIDES:
        if getattr(args, field) is None:
            setattr(args, field, getattr(preset, field))
    if args.fixed_gbs is None and args.smoke:  # two fixed runs keep the CPU smoke test within 3 minutes
        args.fixed_gbs = [args.initial_gbs, args.max_gbs]
    elif args.fixed_gbs is None:
        middle = 2 ** round(math.log2(math.sqrt(args.initial_gbs * args.max_gbs)))
        args.fixed_gbs = sorted({args.initial_gbs, middle, args.max_gbs})
    else:
        args.fixed_gbs = sorted({int(g) for g in args.fixed_gbs.split(",")})
    args.levels = [args.target_ppl * float(f) for f in ("1", *args.ladder.split(","))]
    return args, preset


def main(argv: list[str] | None = None) -> int:
    args, preset = parse_args(argv)
    started = time.time()
    # A SIGTERM (a time limit) unwinds through supervise(), which then stops the run it is watching.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="cona-ttt-")).resolve()
    print(
        f"time_to_target: {preset.model} on {args.data_dir}; P={args.target_ppl:g}; online gbs "
        f"{args.initial_gbs}..{args.max_gbs}; fixed gbs {args.fixed_gbs}; budget {args.budget_s:.0f} s; "
        f"runs in {work}",
        flush=True,
    )
    plans = plan_runs(preset, args, work)
    report: dict[str, Any] = {"settings": _settings(args, preset, plans), "runs": [], "summary": {}}
    for index, plan in enumerate(plans):
        left = args.budget_s - (time.time() - started)
        # What is left, shared in proportion to the caps of the runs still to come (less a save's time).
        cap = min(plan.cap_s, left * plan.cap_s / sum(p.cap_s for p in plans[index:]) - END_MARGIN_S)
        if cap < 10.0:
            print(f"time_to_target: {plan.name} skipped, {left:.0f} s of the budget left", flush=True)
            continue
        print(f"time_to_target: {plan.name} (cap {cap:.0f} s): {' '.join(plan.command[1:])}", flush=True)
        supervised = supervise(plan, target_ppl=args.target_ppl, patience=args.patience, cap_s=cap)
        row = summarize_run(
            name=plan.name,
            kind=plan.kind,
            run_dir=plan.run_dir,
            supervised=supervised,
            target_ppl=args.target_ppl,
            levels=args.levels,
            seq=preset.model["seq"],
        )
        if supervised.exit_code not in (0, None) and supervised.stop == "exited":
            print((plan.root / "cona.log").read_text()[-3000:], flush=True)
        report["runs"].append(row)
        report["summary"] = summary(report["runs"])
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(format_table(report["runs"], args.target_ppl), flush=True)
    print(json.dumps(report["summary"]), flush=True)
    print(f"time_to_target: done in {time.time() - started:.0f} s; JSON {args.out}", flush=True)
    return 0


def _settings(args: argparse.Namespace, preset: Preset, plans: list[RunPlan]) -> dict[str, Any]:
    keys = (*PRESET_OVERRIDES, "fixed_gbs", "levels", "patience", "compile", "botorch")
    return {
        **{key: getattr(args, key) for key in keys},
        "preset": dataclasses.asdict(preset),
        "commands": {plan.name: plan.command[1:] for plan in plans},
    }


if __name__ == "__main__":
    raise SystemExit(main())
