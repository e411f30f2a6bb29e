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

from .report import WARMUP_RUN
from .supervise import RunPlan

PROJECT_ROOT = Path(__file__).resolve().parents[2]


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
    ramp_tokens: tuple[int, ...]
    """Where the ramp doubles its gbs (G0 -> 2G0 at the first, 2G0 -> 4G0 at the second, ...), in consumed
    tokens."""


PRESET_OVERRIDES = ("system", "initial_gbs", "max_gbs", "target_ppl", "total_tokens", "warmup_tokens",
                    "eval_every_tokens", "budget_s", "online_cap_s", "fixed_cap_s", "ramp_cap_s")  # fmt: skip
"""Preset fields that a flag of the same name (``--initial-gbs``) overrides."""

LOG_INTERVAL = 8
"""Iterations between metrics lines, in every run alike (fewer where evaluations come more often). A line
reads the device (a sync), so the same step count between lines keeps that cost the same per step. Online
mode's noise scale needs eight measurements before its first decision; the steps before the first line are
measured (its first step apart, ``cona.engine.trainer.GNS_FIRST_STEPS``), so it has them at the second
line."""

CORPORA = {
    "demo": ("data/demo", "wiki_text_document"),
    "bench": ("data/bench", "bench_text_document"),
    "bench2": ("data/bench2", "bench2_text_document"),
}
"""``--corpus``: the default data folder (under the project root) and dataset name in it. ``bench`` is built
by ``bench/corpus.py``, ``bench2`` (the check corpus: nothing is tuned on it) by ``bench/corpus.py --set
check``."""

SEEDS = (1234, 1235, 1236)
"""``training.seed`` of each repeat of a comparison (model initialisation and data order)."""

_GPT_125M = {"name": "gpt-125m", "layers": 12, "hidden": 768, "heads": 12, "seq": 512}
_H200 = {"device": "cuda", "system": "h200_141g"}
# Demo corpus (1.04M tokens): seq 512 gives ~1,900 train sequences, so a gbs-64 step is 1/30 of an epoch.
_DEMO_125M = Preset(
    model=_GPT_125M, base_gbs=8, base_lr=4e-4, base_min_lr=4e-5, **_H200, initial_gbs=8, max_gbs=64,
    target_ppl=300.0, total_tokens=8_000_000, warmup_tokens=160_000, eval_every_tokens=131_072,
    eval_samples=64, budget_s=540.0, online_cap_s=200.0, fixed_cap_s=120.0, ramp_cap_s=150.0,
    ramp_tokens=(1_000_000, 3_000_000),
)  # fmt: skip
# Bench corpus (~22M tokens). The target (ppl 20) needs about an epoch and 45-60 s of training of the best
# fixed run on one GPU, so that training, not the compile, dominates; the ladder's easier levels compare
# runs that miss it. The LR horizon (32M tokens) is past any target. The LR warm-up of 1.31M tokens (80
# steps at gbs 32) is what the fixed gbs-32 run needs to reach the target soonest; online runs the same one.
_BENCH_125M = dataclasses.replace(
    _DEMO_125M, target_ppl=20.0, total_tokens=32_000_000, warmup_tokens=1_310_720, eval_every_tokens=262_144,
    budget_s=540.0, online_cap_s=260.0, fixed_cap_s=180.0, ramp_cap_s=200.0,
    ramp_tokens=(2_000_000, 8_000_000),
)  # fmt: skip
_BENCH_350M = dataclasses.replace(
    _BENCH_125M, model={"name": "gpt-350m", "layers": 24, "hidden": 1024, "heads": 16, "seq": 512},
    base_lr=3e-4, base_min_lr=3e-5, target_ppl=22.0, total_tokens=24_000_000, fixed_cap_s=200.0,
    ramp_tokens=(1_500_000, 6_000_000), warmup_tokens=327_680,  # not tuned
)  # fmt: skip
# A smaller model: its step is device-bound from a smaller batch. The LR is 1.5x the 125M's (smaller models
# take a larger one); an evaluation every 512k tokens keeps its share of a faster step's time near the 125M's.
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
PRESETS |= {
    (model, "bench2"): preset for (model, corpus), preset in list(PRESETS.items()) if corpus == "bench"
}


def eval_interval(eval_every_tokens: int, gbs: int, seq: int) -> int:
    """Iterations between evaluations so that one falls every ``eval_every_tokens`` tokens at ``gbs``."""
    return max(1, round(eval_every_tokens / (gbs * seq)))


def eval_samples(preset: Preset, max_gbs: int) -> int:
    """The evaluation set's size: ``preset.eval_samples`` rounded up to a multiple of base_gbs and max_gbs.
    The worker rounds it to whole rounds of ``mbs * dp`` samples, so every run evaluates the same samples
    only when each ``mbs * dp`` divides it (true when the gbs values divide max_gbs, as doubling from G0
    gives)."""
    unit = math.lcm(preset.base_gbs, max_gbs)
    return unit * math.ceil(preset.eval_samples / unit)


def conaconfig(
    preset: Preset, args: argparse.Namespace, *, eval_gbs: int, root: Path, seed: int
) -> dict[str, Any]:
    """The run's .conaconfig: the corpus, a per-run index cache (no run inherits another's), logs here."""
    tokenizer = Path(args.tokenizer_dir).resolve()
    interval = eval_interval(args.eval_every_tokens, eval_gbs, preset.model["seq"])
    training = {
        "seed": seed, "device": preset.device, "dtype": "bf16" if preset.device == "cuda" else "fp32",
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


Layout = tuple[int, int, int]
"""(dp, tp, pp)."""


def best_strategy(config_path: Path, system: str, gpus: int, gbs: int, layout: Layout | None = None) -> Any:
    """The planner's best strategy at ``gbs`` on ``gpus`` devices (what online mode would run there),
    ranked as online mode ranks it before it measured anything; ``layout``: the best of that layout only."""
    from cona.config.file import load_config
    from cona.planner.search_choice import search_strategies
    from cona.planner.systems import load_system
    from cona.runner.schedules.online_search import FrontierSearch
    from cona.runner.stage_run import checkpoint_dtype

    config = load_config(config_path, check_data_files=True)
    loaded = load_system(system)
    dtype = loaded.resolve_dtype(checkpoint_dtype(config.training, config.training.runtime.device))
    search = FrontierSearch(config=config, system=loaded, n_gpus=gpus, dtype=dtype, botorch=False)
    if layout is None:
        found = search(gbs)
        if found is None:
            raise SystemExit(f"time_to_target: no strategy on {gpus} device(s) fits gbs {gbs} on {system}")
        return found.strategy
    found_all = search_strategies(
        config.model, loaded, gpus, gbs, options=search.options, dtype=dtype, top_k=1 << 20, botorch=False,
        backend=search.profile,
    )  # fmt: skip
    same = [
        s for s in (found_all.candidates[i] for i in range(len(found_all.candidates))) if _layout(s) == layout
    ]
    if not same:
        raise SystemExit(
            f"time_to_target: the ramp's layout dp{layout[0]}/tp{layout[1]}/pp{layout[2]} fits no strategy "
            f"at gbs {gbs} on {system}"
        )
    return search.estimator.ranked(same, search.model_steps(same))[0].strategy


def _layout(strategy: Any) -> Layout:
    return (strategy.dp, strategy.tp, strategy.pp)


def chain_step(index: int, strategy: Any, iterations: int) -> dict[str, Any]:
    """Step ``index`` (from 0) of a chain: ``strategy`` until the absolute iteration ``iterations``."""
    step = {"step_num": index + 1, "dp": strategy.dp, "tp": strategy.tp, "pp": strategy.pp,
            "gbs": strategy.gbs, "mbs": strategy.mbs, "train_iters": iterations,
            "convert": False}  # fmt: skip
    if index == 0:
        return {**step, "is_initial": True}
    return {**step, "load_dp": strategy.dp, "load_tp": strategy.tp, "load_pp": strategy.pp}


def one_step_chain(strategy: Any, iterations: int) -> dict[str, Any]:
    return {"steps": [chain_step(0, strategy, iterations)]}


def ramp_chain(strategies: list[Any], switch_tokens: list[int], total_tokens: int, seq: int) -> dict:
    """A chain of one layout whose stage k ends at the first iteration whose consumed tokens reach
    ``switch_tokens[k]`` (the last at ``total_tokens``); ``train_iters`` are absolute iterations. Every
    stage keeps the layout, so with ``--switch-in-place`` each switch continues in the workers' memory."""
    ends = [*switch_tokens, total_tokens]
    if (
        len(ends) != len(strategies)
        or any(b <= a for a, b in zip(ends, ends[1:], strict=False))
        or ends[0] <= 0
    ):
        raise SystemExit(
            f"--ramp-tokens: {switch_tokens} must rise, stay below --total-tokens {total_tokens}"
        )
    if len({_layout(s) for s in strategies}) > 1:
        raise SystemExit("time_to_target: the ramp's stages must share one layout (it switches in place)")
    steps, iteration, tokens = [], 0, 0
    for index, (strategy, end) in enumerate(zip(strategies, ends, strict=True)):
        more = max(1, math.ceil((end - tokens) / (strategy.gbs * seq)))
        iteration, tokens = iteration + more, tokens + more * strategy.gbs * seq
        steps.append(chain_step(index, strategy, iteration))
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
    from cona.config.overrides import parse_override
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


def plan_run(name: str, preset: Preset, args: argparse.Namespace, work: Path, *, seed: int) -> RunPlan:
    """The run called ``name`` (see :func:`run_names`) of one seed: its folder, .conaconfig, chain and
    command."""
    root = work / name
    root.mkdir(parents=True)
    seq, config = preset.model["seq"], root / ".conaconfig"
    fixed = name.startswith("fixed-gbs")
    eval_gbs, fixed_overrides = fixed_run_gbs(name, args) if fixed else (args.initial_gbs, [])
    config.write_text(json.dumps(conaconfig(preset, args, eval_gbs=eval_gbs, root=root, seed=seed)))
    common = ["--gpus", str(args.gpus), "--quiet"]
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
        first = _checked_strategy(config, args, preset, args.initial_gbs)
        gbs_steps = [args.initial_gbs * 2**k for k in range(len(args.ramp_tokens) + 1)]
        strategies = [
            first,
            *(_checked_strategy(config, args, preset, g, _layout(first)) for g in gbs_steps[1:]),
        ]
        chain = ramp_chain(strategies, list(args.ramp_tokens), args.total_tokens, seq)
        kind, cap = "ramp", args.ramp_cap_s
        common.append("--switch-in-place")
    else:
        strategy = _checked_strategy(config, args, preset, eval_gbs)
        chain = one_step_chain(strategy, math.ceil(args.total_tokens / (eval_gbs * seq)))
        kind, cap = "fixed", args.fixed_cap_s
        common += _checked_overrides(config, fixed_overrides, flag="--fixed-variant")
    (root / "chain.json").write_text(json.dumps(chain))
    return _plan(name, kind, root, config, ["--chain", str(root / "chain.json"), *common], cap)


WARMUP_ITERATIONS = 16
"""Steps of the warm-up run: two metrics lines, enough to load every library and kernel an eager step uses."""


def plan_warmup(preset: Preset, args: argparse.Namespace, work: Path) -> RunPlan:
    """A short eager fixed run at G0 before the measured ones, left out of the report. The first run of a
    fresh machine loads the CUDA libraries from a cold disk, which would be charged to whichever run came
    first. It compiles nothing, and every run keeps its own compile cache."""
    root = work / WARMUP_RUN
    root.mkdir(parents=True)
    eager = argparse.Namespace(**{**vars(args), "compile": False})
    config = root / ".conaconfig"
    config.write_text(
        json.dumps(conaconfig(preset, eager, eval_gbs=args.initial_gbs, root=root, seed=SEEDS[0]))
    )
    strategy = best_strategy(config, args.system, args.gpus, args.initial_gbs)
    (root / "chain.json").write_text(json.dumps(one_step_chain(strategy, WARMUP_ITERATIONS)))
    extra = ["--chain", str(root / "chain.json"), "--gpus", str(args.gpus), "--quiet"]
    return _plan(WARMUP_RUN, "warmup", root, config, extra, args.fixed_cap_s)


def _checked_overrides(config: Path, overrides: list[str] | None, *, flag: str) -> list[str]:
    """The ``--set`` flags of a variant, once the config loads with them (an unknown key or a bad value is
    refused here, before any run starts, not on the device minutes later)."""
    if not overrides:
        return []
    from cona.config.file import load_config
    from cona.errors import ConaError

    try:
        load_config(config, overrides=overrides)
    except ConaError as error:
        raise SystemExit(f"{flag}: {error}") from None
    return [part for text in overrides for part in ("--set", text)]


def _checked_strategy(
    config: Path, args: argparse.Namespace, preset: Preset, gbs: int, layout: Layout | None = None
) -> Any:
    strategy = best_strategy(config, args.system, args.gpus, gbs, layout)
    if eval_samples(preset, args.max_gbs) % (strategy.mbs * strategy.dp):
        raise SystemExit(
            f"time_to_target: mbs {strategy.mbs} x dp {strategy.dp} at gbs {gbs} would change the "
            "evaluation set"
        )
    return strategy


def _plan(name: str, kind: str, root: Path, config: Path, extra: list[str], cap_s: float) -> RunPlan:
    command = [sys.executable, "-m", "cona", "train", "--config", str(config), "--workdir", str(root)]
    command += ["--run-name", name, "--master-port-base", str(free_port_base()), *extra]
    return RunPlan(
        name=name, kind=kind, command=command, root=root, run_dir=root / "logs" / name, cap_s=cap_s
    )
