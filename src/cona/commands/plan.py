"""``cona plan``: CONA's search run offline on a recorded trace; writes CONA's chain as a chain config.

It also reports, on the same trace and candidates, every static strategy, the hindsight-optimal chain and
their predicted times to the target (see :mod:`cona.planner.plan`).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from cona.commands.config_flags import add_config_flags
from cona.commands.flag_types import finite_float, positive_int
from cona.commands.plan_curves import add_curves_flags, run_curves
from cona.commands.search_flags import add_search_flags, botorch_choice
from cona.config import ConaConfig
from cona.config.file import load_config
from cona.errors import PlanError, UsageError
from cona.planner.plan import (
    DEFAULT_SEGMENTS,
    ChainPlan,
    PlanResult,
    SearchSettings,
    chain_config,
    plan,
    space_options,
    target_progress,
)
from cona.planner.policy import DEFAULT_HYSTERESIS, PolicySettings
from cona.planner.profiles import BACKENDS, BackendProfile, run_profile
from cona.planner.systems import System, load_system
from cona.planner.throughput import ThroughputEstimator, estimator_from_step_times, fitted_forms
from cona.planner.trace import Trace, read_trace

DESCRIPTION = (
    "Run CONA's strategy search and switching policy offline on a recorded trace (a run "
    "directory or its metrics.jsonl): the noise scale over training and the measured step times (which "
    "calibrate the performance model). Prints the predicted time to the target of every static "
    "strategy, of the hindsight-optimal chain and of CONA's online chain, and writes CONA's chain as a "
    "chain config for 'cona train --chain'. With --curves FILE --system S --gpus N instead: the same "
    "comparison on a cluster, simulated from measured eval-loss curves of fixed-gbs runs and the "
    "performance model (with its published error carried into the answer)."
)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="Plan a strategy chain offline on a recorded trace, or on a cluster from measured curves",
        description=DESCRIPTION,
    )
    parser.add_argument("--trace", default=None, help="run directory or metrics.jsonl")
    add_curves_flags(parser)
    parser.add_argument("--out", default=None, help="chain config to write (JSON; required with --trace)")
    parser.add_argument(
        "--system", required=True, help="system name (cona systems lists them) or system JSON file"
    )
    parser.add_argument("--gpus", type=positive_int, default=None, help="GPU count (default: the trace's)")
    parser.add_argument(
        "--initial-gbs", type=positive_int, default=None, help="first gbs (default: the trace's)"
    )
    max_help = (
        "largest gbs the frontier may reach (required with --trace; default with --curves: the largest)"
    )
    parser.add_argument("--max-gbs", type=positive_int, default=None, help=max_help)
    goal = parser.add_mutually_exclusive_group()
    goal.add_argument(
        "--total-tokens", type=finite_float, default=None, help="train as far as the trace did in T tokens"
    )
    goal.add_argument(
        "--total-iters", type=positive_int, default=None, help="as --total-tokens, I x initial gbs x seq"
    )
    goal.add_argument("--target-loss", type=finite_float, default=None, help="train to the trace's loss L")
    goal.add_argument(
        "--target-ppl", type=finite_float, default=None, help="train to the perplexity P (loss ln P)"
    )
    parser.add_argument(
        "--switch-cost-s",
        type=finite_float,
        default=None,
        help="seconds a switch costs (default: the mean measured at the trace's stage changes; with --curves "
        "each switch is charged its predicted cost)",
    )
    add_search_flags(parser)
    parser.add_argument(
        "--hysteresis", type=finite_float, default=DEFAULT_HYSTERESIS, help="switch margin (0.05)"
    )
    parser.add_argument(
        "--segments",
        type=positive_int,
        default=DEFAULT_SEGMENTS,
        help=f"evaluations over the run ({DEFAULT_SEGMENTS})",
    )
    parser.add_argument(
        "--dtype", choices=("bf16", "fp16", "fp32"), default=None, help="default: training.dtype"
    )
    add_config_flags(parser)
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default=None,
        help="the backend whose profile predicts the strategies (default: the trace's, else native)",
    )
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if args.curves is not None:
        return run_curves(args)
    for flag, value in (("--trace", args.trace), ("--out", args.out), ("--max-gbs", args.max_gbs)):
        if value is None:
            raise UsageError(f"{flag}: required (unless --curves simulates a cluster from measured curves)")
    config = load_config(args.config, overrides=args.overrides)
    system = load_system(args.system)
    trace = read_trace(args.trace, training=config.training)
    gpus = args.gpus if args.gpus is not None else trace.world_size
    if gpus is None:
        raise UsageError("--gpus: the trace names no dp/tp/pp to take the GPU count from; pass --gpus")
    initial_gbs = args.initial_gbs if args.initial_gbs is not None else int(trace.gbs[0])
    if args.max_gbs < initial_gbs:
        raise UsageError(f"--max-gbs: {args.max_gbs} is below the initial gbs {initial_gbs}")
    dtype = args.dtype or config.training.runtime.dtype
    # The trace's run mode (compiled, CUDA graphs) picks the profile's host dispatch, as online mode's does.
    backend = run_profile(args.backend or trace.backend, config.training)
    estimator, calibration_note = _estimator(config, trace, system, gpus, dtype, backend)
    search = SearchSettings(
        backend=backend,
        system=system,
        n_gpus=gpus,
        dtype=dtype,
        options=space_options(config.training),
        estimator=estimator,
        botorch=botorch_choice(args),
    )
    # As online mode runs it in a worker session: a switch that keeps the layout is made in place, probed.
    policy = PolicySettings.from_training(
        config.training, max_gbs=args.max_gbs, hysteresis=args.hysteresis, in_place=True
    )
    progress, target_note = _target(args, config, trace, initial_gbs)
    result = plan(
        config,
        trace,
        search=search,
        policy=policy,
        initial_gbs=initial_gbs,
        progress=progress,
        switch_cost_s=_switch_cost(args, trace),
        segments=args.segments,
    )
    raw = chain_config(result.online.stages)
    _check_chain(raw, Path(args.out), config, gpus, system.resolve_dtype(dtype))
    try:
        Path(args.out).write_text(json.dumps(raw, indent=2) + "\n")
    except OSError as err:
        raise PlanError(f"--out: cannot write {args.out}: {err.strerror}") from None
    print(f"trace: {trace.source}; {target_note}")
    print(f"model: {calibration_note}")
    _print_report(result)
    print(f"wrote CONA's chain ({len(raw['steps'])} steps) to {args.out}")
    return 0


def _target(
    args: argparse.Namespace, config: ConaConfig, trace: Trace, initial_gbs: int
) -> tuple[float, str]:
    base, factor = config.training.lr.base_gbs, config.training.online.noise_scale_factor
    if args.target_ppl is not None or args.target_loss is not None:
        if args.target_ppl is not None and not args.target_ppl > 1:
            raise UsageError(f"--target-ppl must be above 1, got {args.target_ppl}")
        loss = math.log(args.target_ppl) if args.target_ppl is not None else args.target_loss
        progress = target_progress(trace, base, target_loss=loss, noise_scale_factor=factor)
        return (
            progress,
            f"target {trace.loss_kind} {loss:.4g}, reached at {trace.tokens_at_loss(loss):.4g} tokens",
        )
    tokens = args.total_tokens
    if args.total_iters is not None:
        tokens = float(args.total_iters * initial_gbs * config.model.seq)
    progress = target_progress(trace, base, total_tokens=tokens, noise_scale_factor=factor)
    spent = (
        f"{tokens:.4g} tokens" if tokens is not None else f"the whole trace ({trace.tokens[-1]:.4g} tokens)"
    )
    return progress, f"target: the progress the trace made in {spent}"


def _switch_cost(args: argparse.Namespace, trace: Trace) -> float:
    if args.switch_cost_s is not None:
        return args.switch_cost_s
    if not trace.switch_costs_s:
        raise UsageError(
            "--switch-cost-s: the trace has no stage change to measure a switch cost from; pass it"
        )
    return sum(trace.switch_costs_s) / len(trace.switch_costs_s)


def _estimator(
    config: ConaConfig, trace: Trace, system: System, gpus: int, dtype: str, backend: BackendProfile
) -> tuple[ThroughputEstimator, str]:
    """Online mode's throughput estimator on the trace's step times, when they were measured on the GPU
    count planned for: the strategies the trace trained are taken at their measured rates, the others
    predicted by the model fitted in shape on them."""
    empty = ThroughputEstimator(seq=config.model.seq, forms=fitted_forms(system, backend))
    if not trace.timed:
        return empty, "uncalibrated (the trace has no step_time_s)"
    if trace.world_size != gpus:
        return empty, f"uncalibrated (the trace ran on {trace.world_size} processes, the plan is for {gpus})"
    estimator = estimator_from_step_times(
        list(trace.timed), config.model, system, seq=config.model.seq, dtype=dtype, backend=backend
    )
    fit = estimator.shape.describe()
    return estimator, (
        f"{len(trace.timed)} {'strategy' if len(trace.timed) == 1 else 'strategies'} at the measured "
        "throughput, the others predicted by the model "
        f"fitted on them ({fit})"
    )


def _check_chain(raw: dict, out: Path, config: ConaConfig, gpus: int, dtype: str) -> None:
    from cona.runner.chain_file import parse_chain  # deferred: it imports the engine (torch)

    parse_chain(raw, source=out, config=config, world_size=gpus, dtype=dtype, workdir=Path.cwd())


def _print_report(result: PlanResult) -> None:
    print("\nbest strategy per gbs:")
    for candidate in result.candidates:
        rate = f"{candidate.predicted_tokens_per_s:14,.0f} tokens/s"
        print(f"  {candidate.strategy.short():36s} {rate} ({candidate.throughput_source})")
    optimum = result.optimum.time_s
    print(f"\n{'plan':24s} {'time to target':>16s} {'vs optimum':>11s} {'switches':>9s}  chain")
    rows = [*result.static, result.optimum, result.online]
    for row in rows:
        ratio = row.time_s / optimum
        print(
            f"{row.name:24s} {_duration(row.time_s):>16s} {ratio:>10.4f}x {row.switches:>9d}  {_chain(row)}"
        )
    best, worst = result.best_static, result.worst_static
    print(
        f"\nCONA: {result.online.time_s / optimum - 1:+.2%} vs the hindsight optimum; "
        f"the best static ({best.name}) takes {best.time_s / result.online.time_s:.3f}x CONA's time, "
        f"the worst ({worst.name}) {worst.time_s / result.online.time_s:.3f}x; "
        f"switch cost {result.switch_cost_s:.1f} s"
    )
    for record in result.decisions:
        print(f"  {record['decision']} at iteration {record['iteration']}: {record['reason']}")


def _chain(plan: ChainPlan) -> str:
    return " -> ".join(f"gbs {stage.strategy.gbs} x {stage.iterations} it" for stage in plan.stages)


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.2f} h"
    return f"{seconds:.1f} s"
