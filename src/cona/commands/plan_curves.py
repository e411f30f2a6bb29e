"""``cona plan --curves FILE --system S --gpus N``: CONA's chain on a cluster and its time to a target
against the baselines, simulated from measured statistical curves (:mod:`cona.planner.simulate`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

from cona.commands.search_flags import botorch_choice
from cona.config import ConaConfig, TrainingConfig
from cona.config.file import load_config
from cona.errors import PlanError, UsageError
from cona.planner.cluster import Cluster, curves_world, policy_settings
from cona.planner.curves import StatCurves, load_curves
from cona.planner.plan import ChainPlan, chain_config, space_options
from cona.planner.profiles import run_profile
from cona.planner.published import error_summary, published_points
from cona.planner.simulate import Comparison, ErrorSpread, ModelError, World, compare_with_error
from cona.planner.switch_cost import IN_PLACE_S
from cona.planner.systems import load_system

DEFAULT_DRAWS = 32
NOT_WITH_CURVES = ("trace", "total_tokens", "total_iters", "switch_cost_s")


def add_curves_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--curves",
        default=None,
        help="a statistical curves file (bench/stat_curves.py) instead of --trace: simulate the cluster",
    )
    parser.add_argument(
        "--error-draws",
        type=int,
        default=DEFAULT_DRAWS,
        help=f"with --curves: worlds with the model's throughput perturbed by its error ({DEFAULT_DRAWS})",
    )


def run_curves(args: argparse.Namespace) -> int:
    for name in NOT_WITH_CURVES:
        if getattr(args, name, None) is not None:
            raise UsageError(f"--{name.replace('_', '-')} does not go with --curves")
    if args.gpus is None:
        raise UsageError("--gpus: give the cluster's GPU count with --curves")
    if args.error_draws < 1:
        raise UsageError(f"--error-draws must be at least 1, got {args.error_draws}")
    curves = load_curves(args.curves)
    training = _training(args, curves)
    initial_gbs = args.initial_gbs or curves.gbs[0]
    max_gbs = args.max_gbs or curves.gbs[-1]
    if max_gbs < initial_gbs:
        raise UsageError(f"--max-gbs: {max_gbs} is below the initial gbs {initial_gbs}")
    system = load_system(args.system)
    cluster = Cluster(
        system=system, gpus=args.gpus, dtype=args.dtype or training.runtime.dtype,
        backend=run_profile(args.backend or "native", training), botorch=botorch_choice(args),
        options=space_options(training),
    )  # fmt: skip
    target = _target_loss(args, curves)
    world = curves_world(
        curves, cluster, initial_gbs=initial_gbs, max_gbs=max_gbs, target_loss=target, segments=args.segments
    )
    settings = dataclasses.replace(policy_settings(curves, max_gbs, training), hysteresis=args.hysteresis)
    points = published_points()
    mean, largest = error_summary(points)
    spread = compare_with_error(
        world, settings, ModelError(mean=mean, largest=largest, draws=args.error_draws)
    )
    _print_header(curves, cluster, target, len(points), mean, largest, args.error_draws)
    _print_table(world, spread)
    if args.out:
        _write_chain(args.out, spread.nominal.online, curves, training, cluster)
    return 0


def _training(args: argparse.Namespace, curves: StatCurves) -> TrainingConfig:
    """The config's policy keys when --config is given (its base_gbs must be the curves'), else defaults."""
    if args.config is None and not args.overrides:
        return TrainingConfig(base_gbs=curves.base_gbs)
    training = load_config(args.config, overrides=args.overrides).training
    if training.lr.base_gbs != curves.base_gbs:
        raise UsageError(
            f"training.base_gbs: {training.lr.base_gbs} differs from the curves' base_gbs {curves.base_gbs} "
            f"({curves.source}); the LR rule and efficiency are relative to it"
        )
    return training


def _target_loss(args: argparse.Namespace, curves: StatCurves) -> float:
    """--target-loss, --target-ppl, else the lowest loss that every curve reaches."""
    if args.target_ppl is not None:
        if not args.target_ppl > 1:
            raise UsageError(f"--target-ppl must be above 1, got {args.target_ppl}")
        return math.log(args.target_ppl)
    if args.target_loss is not None:
        return args.target_loss
    return max(float(curve.eval_loss.min()) for curve in curves.curves)


def _print_header(
    curves: StatCurves, cluster: Cluster, target: float, points: int, mean: float, largest: float, draws: int
) -> None:
    recorded = curves.recorded
    where = (
        "SYNTHETIC (not measured)"
        if curves.synthetic
        else f"measured on {recorded.get('card', '?')}, {recorded.get('date', '?')}"
    )
    nodes = -(-cluster.gpus // cluster.system.gpus_per_node)
    print(
        f"curves: {curves.source}, {where}; model {curves.model.name}, gbs {', '.join(map(str, curves.gbs))}"
    )
    print(f"target: eval loss {target:.4g} (perplexity {math.exp(target):.4g})")
    print(
        f"system: {cluster.system.name}, {cluster.gpus} GPUs ({nodes} node{'s' if nodes > 1 else ''} of "
        f"{cluster.system.gpus_per_node}); performance model error on {points} published points: mean "
        f"{mean:.1%}, max {largest:.1%}; {draws} perturbed worlds"
    )


def _print_table(world: World, spread: ErrorSpread) -> None:
    print("\nbest strategy per gbs (performance model; what a static planner picks for that gbs):")
    for candidate in world.candidates:
        print(f"  {candidate.strategy.short():36s} {candidate.predicted_tokens_per_s:14,.0f} tokens/s")
    for reason in world.left_out:
        print(f"  left out: {reason}")
    nominal = spread.nominal
    print("\n| plan | time to target | CONA's speed-up over it | over the perturbed worlds | chain |")
    print("|---|---:|---:|---:|---|")
    picks = (lambda c: c.static_user, lambda c: c.tuned_fixed, lambda c: c.ramp)
    for pick in picks:
        plan = pick(nominal)
        value, low, high = spread.speedups(pick)
        within = " (within the model's error)" if low <= 1.0 <= high else ""
        print(
            f"| {plan.name} | {_duration(plan.time_s)} | {value:.2f}x | {low:.2f}-{high:.2f}x{within} | "
            f"{_chain(plan)} |"
        )
    print(
        f"| {nominal.online.name} | {_duration(nominal.online.time_s)} | - | - | {_chain(nominal.online)} |"
    )
    value, low, high = spread.to_optimum()
    print(
        f"| {nominal.optimum.name} | {_duration(nominal.optimum.time_s)} | CONA {value:+.1%} from it | "
        f"{low:+.1%} to {high:+.1%} | {_chain(nominal.optimum)} |"
    )
    costs = sorted({round(float(c), 1) for c in world.switch_costs_s.flat if c > 0})
    print(
        f"\nswitch costs charged (predicted): {IN_PLACE_S:g} s in place where the layout is kept, else a "
        f"checkpoint save and load: {', '.join(f'{c:g} s' for c in costs if c != IN_PLACE_S) or 'none'}"
    )
    _print_decisions(nominal)


def _print_decisions(comparison: Comparison) -> None:
    for record in comparison.decisions:
        print(f"  {record['decision']} at iteration {record['iteration']}: {record['reason']}")


def _chain(plan: ChainPlan) -> str:
    return " -> ".join(
        f"gbs {s.strategy.gbs} dp{s.strategy.dp}/tp{s.strategy.tp}/pp{s.strategy.pp}" for s in plan.stages
    )


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:.2f} h" if seconds >= 3600 else f"{seconds:.1f} s"


def _write_chain(
    out: str, plan: ChainPlan, curves: StatCurves, training: TrainingConfig, cluster: Cluster
) -> None:
    from cona.runner.chain_file import parse_chain  # deferred: it imports the engine (torch)

    raw = chain_config(plan.stages)
    config = ConaConfig(model=curves.model, training=training)
    dtype = cluster.system.resolve_dtype(cluster.dtype)
    parse_chain(
        raw, source=Path(out), config=config, world_size=cluster.gpus, dtype=dtype, workdir=Path.cwd()
    )
    try:
        Path(out).write_text(json.dumps(raw, indent=2) + "\n")
    except OSError as err:
        raise PlanError(f"--out: cannot write {out}: {err.strerror}") from None
    print(f"wrote CONA's chain ({len(raw['steps'])} steps) to {out}")
