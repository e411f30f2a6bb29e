"""The time-to-target benchmark's presets and the runs it plans: each run's .conaconfig, chain and command."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ttt_report import WARMUP_RUN
from ttt_supervise import RunPlan

PROJECT_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True, kw_only=True)
class Preset:
    """A model on a corpus and the knobs that go with it (every one can be overridden by a flag)."""

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
    ramp_cap_s: float
    ramp_tokens: tuple[int, int]
    """Where the ramp switches G0 -> 2G0 and 2G0 -> 4G0, in consumed tokens."""


PRESET_OVERRIDES = ("system", "initial_gbs", "max_gbs", "target_ppl", "total_tokens", "warmup_tokens",
                    "eval_every_tokens", "budget_s", "online_cap_s", "fixed_cap_s", "ramp_cap_s")  # fmt: skip
"""Preset fields that a flag of the same name (``--initial-gbs``) overrides."""

LOG_INTERVAL = 8
"""Iterations between metrics lines, in every run alike (fewer where evaluations come more often). A line
reads the device (a sync), so the same step count between lines keeps that cost the same per step. Online
mode's noise scale needs eight measurements before its first decision; the steps before the first line are
measured (its first step apart, ``cona.engine.trainer.GNS_FIRST_STEPS``), so it has them at the second line
(iteration 16), where one measurement a line took 64 iterations (issue 16)."""

CORPORA = {"demo": ("data/demo", "wiki_text_document"), "bench": ("data/bench", "bench_text_document")}
"""``--corpus``: the default data folder (under the project root) and dataset name in it."""

_GPT_125M = {"name": "gpt-125m", "layers": 12, "hidden": 768, "heads": 12, "seq": 512}
_H200 = {"device": "cuda", "system": "h200_141g"}
# Demo corpus (1.04M tokens): seq 512 gives ~1,900 train sequences, so a gbs-64 step is 1/30 of an epoch.
_DEMO_125M = Preset(
    model=_GPT_125M, base_gbs=8, base_lr=4e-4, base_min_lr=4e-5, **_H200, initial_gbs=8, max_gbs=64,
    target_ppl=300.0, total_tokens=8_000_000, warmup_tokens=160_000, eval_every_tokens=131_072,
    eval_samples=64, budget_s=540.0, online_cap_s=200.0, fixed_cap_s=120.0, ramp_cap_s=150.0,
    ramp_tokens=(1_000_000, 3_000_000),
)  # fmt: skip
# Bench corpus (22.2M tokens). On the H200 (2026-12-01, docs/benchmarks.md) the best fixed run (gbs 16)
# reached ppl 27 at 9.2M tokens, 53.5 s from its first step, of which ~30 s were the first step's compile:
# only ~23 s of training. The target is therefore ppl 20, an estimate for ~45-60 s of training (about an
# epoch); the ladder's easier levels (27.5 = 1.1x ... ) still compare runs that miss it. With --stop-behind
# the 125M comparison fits two calls of <= 9.5 minutes (best fixed first, then online, then the others
# capped at 1.3x its time); the LR horizon (32M tokens) is past any target. The LR warm-up is 1.31M tokens
# (80 steps at gbs 32): with the 327,680 of sessions 1-27 fixed gbs 32 took 62.8 s to ppl 20 (18.35M tokens),
# with 1.31M 47.5-48.3 s (13.9-14.2M) and with 2.62M 45.3 s (13.6M) on the H200 (docs/benchmarks.md,
# twenty-eighth session): a fixed baseline needs a warm-up tuned for its batch, and online runs the same one.
_BENCH_125M = dataclasses.replace(
    _DEMO_125M, target_ppl=20.0, total_tokens=32_000_000, warmup_tokens=1_310_720, eval_every_tokens=262_144,
    budget_s=540.0, online_cap_s=260.0, fixed_cap_s=180.0, ramp_cap_s=200.0,
    ramp_tokens=(2_000_000, 8_000_000),
)  # fmt: skip
_BENCH_350M = dataclasses.replace(
    _BENCH_125M, model={"name": "gpt-350m", "layers": 24, "hidden": 1024, "heads": 16, "seq": 512},
    base_lr=3e-4, base_min_lr=3e-5, target_ppl=22.0, total_tokens=24_000_000, fixed_cap_s=200.0,
    ramp_tokens=(1_500_000, 6_000_000), warmup_tokens=327_680,  # untuned (docs/benchmarks.md, 29th session)
)  # fmt: skip
# A smaller model, to test whether a one-GPU ramp has room there (twenty-eighth session's estimate: the
# eager step would stay host-bound to a larger batch). Measured on an H100 (twenty-ninth session,
# docs/benchmarks.md) it does not: 477k-598k tokens/s at gbs 16-128, device-bound from gbs 16-32, and
# online tied fixed gbs 32 at ppl 18 (33 s, the hardest level the best fixed run reached, so the target).
# The LR is 1.5x the 125M's (smaller models take a larger one); an evaluation every 512k tokens keeps its
# share of a faster step's time near the 125M's.
_BENCH_45M = dataclasses.replace(
    _BENCH_125M, model={"name": "gpt-45m", "layers": 6, "hidden": 512, "heads": 8, "seq": 512},
    base_lr=6e-4, base_min_lr=6e-5, initial_gbs=16, max_gbs=128, target_ppl=18.0, total_tokens=64_000_000,
    eval_every_tokens=524_288, ramp_tokens=(2_000_000, 6_000_000),
)  # fmt: skip
_SMOKE = Preset(
    model={"name": "gpt-tiny", "layers": 4, "hidden": 64, "heads": 4, "seq": 128,
           "attention_dropout": 0.0, "hidden_dropout": 0.0},
    base_gbs=2, base_lr=2e-3, base_min_lr=2e-4, device="cpu", system="cpu_gloo",
    initial_gbs=2, max_gbs=8, target_ppl=48_000.0, total_tokens=8_192, warmup_tokens=256,
    eval_every_tokens=512, eval_samples=8, budget_s=420.0, online_cap_s=130.0, fixed_cap_s=110.0,
    ramp_cap_s=130.0, ramp_tokens=(256, 768),
)  # fmt: skip
PRESETS = {
    ("125m", "demo"): _DEMO_125M,
    ("45m", "bench"): _BENCH_45M,
    ("125m", "bench"): _BENCH_125M,
    ("350m", "bench"): _BENCH_350M,
    ("350m", "demo"): dataclasses.replace(_BENCH_350M, **{f: getattr(_DEMO_125M, f) for f in (
        "target_ppl", "total_tokens", "warmup_tokens", "eval_every_tokens", "ramp_tokens")}),
    ("tiny", "demo"): _SMOKE,
}  # fmt: skip


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
    """The run's .conaconfig: the corpus, a per-run index cache (no run inherits another's), logs here."""
    tokenizer = Path(args.tokenizer_dir).resolve()
    interval = eval_interval(args.eval_every_tokens, eval_gbs, preset.model["seq"])
    training = {
        "seed": 1234, "device": preset.device, "dtype": "bf16" if preset.device == "cuda" else "fp32",
        "zero_stage": 1, "compile": bool(args.compile), "base_gbs": preset.base_gbs,
        "base_lr": preset.base_lr, "base_min_lr": preset.base_min_lr, "lr_scale_strategy": "sqrt",
        "lr_warmup_tokens": args.warmup_tokens, "lr_decay_tokens": args.total_tokens, "weight_decay": 0.1,
        "split": "949,50,1", "data_prefix": str(Path(args.data_dir).resolve() / args.data_prefix),
        "vocab_file": str(tokenizer / "gpt2-vocab.json"), "merge_file": str(tokenizer / "gpt2-merges.txt"),
        "tokenizer_type": "GPT2BPETokenizer", "data_cache_path": str(root / "index-cache"),
        "log_interval": min(LOG_INTERVAL, interval), "eval_interval": interval,
        "eval_every_tokens": args.eval_every_tokens,
        "eval_iters": eval_samples(preset, args.max_gbs) // preset.base_gbs, "log_root": str(root / "logs"),
        "wandb_mode": "disabled",
    }  # fmt: skip
    return {"model": dict(preset.model), "training": training}


def best_mbs(config_path: Path, system: str, gbs: int) -> int:
    """The micro-batch of the planner's best one-device strategy at ``gbs`` (what online mode would run)."""
    from cona.config_file import load_config
    from cona.planner.systems import load_system
    from cona.runner.schedules.online_search import FrontierSearch
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


def ramp_chain(stages: list[tuple[int, int]], switch_tokens: list[int], total_tokens: int, seq: int) -> dict:
    """A one-device chain of ``(gbs, mbs)`` stages; stage k ends at the first iteration whose consumed tokens
    reach ``switch_tokens[k]`` (the last at ``total_tokens``). ``train_iters`` are absolute iterations."""
    ends = [*switch_tokens, total_tokens]
    if len(ends) != len(stages) or any(b <= a for a, b in zip(ends, ends[1:], strict=False)) or ends[0] <= 0:
        raise SystemExit(
            f"--ramp-tokens: {switch_tokens} must rise, stay below --total-tokens {total_tokens}"
        )
    steps, iteration, tokens = [], 0, 0
    for index, ((gbs, mbs), end) in enumerate(zip(stages, ends, strict=True)):
        more = max(1, math.ceil((end - tokens) / (gbs * seq)))
        iteration, tokens = iteration + more, tokens + more * gbs * seq
        step = {
            "step_num": index + 1,
            "dp": 1,
            "tp": 1,
            "pp": 1,
            "gbs": gbs,
            "mbs": mbs,
            "train_iters": iteration,
        }
        step |= {"is_initial": True} if index == 0 else {"load_dp": 1, "load_tp": 1, "load_pp": 1}
        steps.append({**step, "convert": index < len(stages) - 1})
    return {"steps": steps}


def free_port_base() -> int:
    """A base port whose stage-1 port (base + 1) is free now; the runs get distinct bases."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1] - 1


def run_names(args: argparse.Namespace) -> list[str]:
    """Every run this set-up can make, in the default order: online and its variants, then the smallest and
    largest fixed gbs (they bound the result if the budget runs out before the middle ones), the middle
    ones, the ramp."""
    fixed = sorted(args.fixed_gbs)
    order = [fixed[0], fixed[-1], *fixed[1:-1]] if len(fixed) > 1 else fixed
    variants = [f"{ONLINE_VARIANT_PREFIX}{name}" for name in getattr(args, "online_variants", {})]
    varied_fixed = list(getattr(args, "fixed_variants", {}))  # names fixed-gbsG-NAME already
    return ["online", *variants, *(f"fixed-gbs{gbs}" for gbs in order), *varied_fixed, "ramp"]


ONLINE_VARIANT_PREFIX = "online-"
"""``--online-variant NAME ...`` adds the run ``online-NAME``: online mode with config keys set."""


def online_variants(given: list[list[str]] | None) -> dict[str, list[str]]:
    """``--online-variant NAME SECTION.KEY=VALUE ...`` (repeatable) as ``{NAME: [override, ...]}``: each
    override is one ``cona train --set`` (e.g. ``training.fallback_ema_alpha=1``), so policy settings can be
    compared with online mode's defaults in one call, on one machine."""
    variants: dict[str, list[str]] = {}
    for name, *overrides in given or []:
        if not name.replace("_", "").isalnum() or name in variants or not overrides:
            raise SystemExit(
                f"--online-variant {name}: give a new name (letters, digits, _) and one or more "
                "SECTION.KEY=VALUE"
            )
        variants[name] = _parsed_overrides(f"--online-variant {name}", overrides)
    return variants


def fixed_variants(given: list[list[str]] | None) -> dict[str, tuple[int, list[str]]]:
    """``--fixed-variant NAME GBS SECTION.KEY=VALUE ...`` (repeatable) as ``{"fixed-gbsGBS-NAME": (GBS,
    [override, ...])}``: a fixed run at GBS with config keys set, e.g. another LR rule. It is a fixed run
    like the others, so it competes for the best fixed one."""
    variants: dict[str, tuple[int, list[str]]] = {}
    for entry in given or []:
        name, gbs, *overrides = entry if len(entry) >= 3 else ["", ""]
        if not (name.replace("_", "").isalnum() and gbs.isdigit() and int(gbs) > 0):
            raise SystemExit(
                f"--fixed-variant {' '.join(entry)}: give a name (letters, digits, _), a gbs and one or more "
                "SECTION.KEY=VALUE"
            )
        run = f"fixed-gbs{gbs}-{name}"
        if run in variants:
            raise SystemExit(f"--fixed-variant: {run} given twice")
        variants[run] = (int(gbs), _parsed_overrides(f"--fixed-variant {name}", overrides))
    return variants


def _parsed_overrides(flag: str, overrides: list[str]) -> list[str]:
    from cona.config_overrides import parse_override
    from cona.errors import UsageError

    for text in overrides:
        try:
            parse_override(text)
        except UsageError as error:
            raise SystemExit(f"{flag}: {error}") from None
    return overrides


def fixed_run_gbs(name: str, args: argparse.Namespace) -> tuple[int, list[str]]:
    """The gbs of a fixed run (``fixed-gbsG`` or a ``--fixed-variant``) and the config keys it sets."""
    variant = getattr(args, "fixed_variants", {}).get(name)
    return variant if variant is not None else (int(name.removeprefix("fixed-gbs")), [])


def plan_run(name: str, preset: Preset, args: argparse.Namespace, work: Path) -> RunPlan:
    """The run called ``name`` (see :func:`run_names`): its folder, .conaconfig, chain and command."""
    root = work / name
    root.mkdir(parents=True)
    seq, config = preset.model["seq"], root / ".conaconfig"
    fixed = name.startswith("fixed-gbs")
    eval_gbs, fixed_overrides = fixed_run_gbs(name, args) if fixed else (args.initial_gbs, [])
    config.write_text(json.dumps(conaconfig(preset, args, eval_gbs=eval_gbs, root=root)))
    common = ["--gpus", "1", "--quiet"]
    if name == "online" or name.startswith(ONLINE_VARIANT_PREFIX):
        extra = [
            "--system",
            args.system,
            "--initial-gbs",
            str(args.initial_gbs),
            "--max-gbs",
            str(args.max_gbs),
        ]
        extra += ["--target-ppl", f"{args.target_ppl:g}", "--total-tokens", str(args.total_tokens)]
        extra += [] if args.botorch else ["--no-botorch"]
        variant = name.removeprefix(ONLINE_VARIANT_PREFIX) if name != "online" else None
        overrides = getattr(args, "online_variants", {}).get(variant)
        extra += _checked_overrides(config, overrides, flag="--online-variant")
        return _plan(name, "online", root, config, [*common, *extra], args.online_cap_s)
    if name == "ramp":
        gbs_steps = [args.initial_gbs * 2**k for k in range(len(args.ramp_tokens) + 1)]
        stages = [(gbs, _checked_mbs(config, args, preset, gbs)) for gbs in gbs_steps]
        chain = ramp_chain(stages, list(args.ramp_tokens), args.total_tokens, seq)
        kind, cap = "ramp", args.ramp_cap_s
    else:
        gbs = eval_gbs
        chain = one_step_chain(
            gbs, _checked_mbs(config, args, preset, gbs), math.ceil(args.total_tokens / (gbs * seq))
        )
        kind, cap = "fixed", args.fixed_cap_s
        common += _checked_overrides(config, fixed_overrides, flag="--fixed-variant")
    (root / "chain.json").write_text(json.dumps(chain))
    return _plan(name, kind, root, config, ["--chain", str(root / "chain.json"), *common], cap)


WARMUP_ITERATIONS = 16
"""Steps of the warm-up run: two metrics lines, enough to load every library and kernel an eager step uses."""


def plan_warmup(preset: Preset, args: argparse.Namespace, work: Path) -> RunPlan:
    """A short eager fixed run at G0 before the measured ones, left out of the report. The first run of a
    fresh machine loads the CUDA libraries from a cold disk: on the H200 an eager online run that came first
    took 2.9 s for its first step against 0.8 s for a fixed gbs-8 run after it (issue 16), which is the
    order, not the mode. It compiles nothing, and every run keeps its own compile cache."""
    root = work / WARMUP_RUN
    root.mkdir(parents=True)
    eager = argparse.Namespace(**{**vars(args), "compile": False})
    config = root / ".conaconfig"
    config.write_text(json.dumps(conaconfig(preset, eager, eval_gbs=args.initial_gbs, root=root)))
    gbs = args.initial_gbs
    (root / "chain.json").write_text(
        json.dumps(one_step_chain(gbs, best_mbs(config, args.system, gbs), WARMUP_ITERATIONS))
    )
    extra = ["--chain", str(root / "chain.json"), "--gpus", "1", "--quiet"]
    return _plan(WARMUP_RUN, "warmup", root, config, extra, args.fixed_cap_s)


def _checked_overrides(config: Path, overrides: list[str] | None, *, flag: str) -> list[str]:
    """The ``--set`` flags of a variant, once the config loads with them (an unknown key or a bad value is
    refused here, before any run starts, not on the device minutes later)."""
    if not overrides:
        return []
    from cona.config_file import load_config
    from cona.errors import ConaError

    try:
        load_config(config, overrides=overrides)
    except ConaError as error:
        raise SystemExit(f"{flag}: {error}") from None
    return [part for text in overrides for part in ("--set", text)]


def _checked_mbs(config: Path, args: argparse.Namespace, preset: Preset, gbs: int) -> int:
    mbs = best_mbs(config, args.system, gbs)
    if eval_samples(preset, args.max_gbs) % mbs:
        raise SystemExit(f"time_to_target: mbs {mbs} at gbs {gbs} would change the evaluation set")
    return mbs


def _plan(name: str, kind: str, root: Path, config: Path, extra: list[str], cap_s: float) -> RunPlan:
    command = [sys.executable, "-m", "cona", "train", "--config", str(config), "--workdir", str(root)]
    command += ["--run-name", name, "--master-port-base", str(free_port_base()), *extra]
    return RunPlan(
        name=name, kind=kind, command=command, root=root, run_dir=root / "logs" / name, cap_s=cap_s
    )
