"""Offline simulation of CONA's switching policy against the hindsight-optimal chain and static strategies.

    .venv/bin/python bench/plan_simulation.py              # every scenario, exhaustive search
    .venv/bin/python bench/plan_simulation.py --botorch    # the frontier searches by Bayesian optimisation

Each scenario: a model on N GPUs of a system, a synthetic trace of the shape the references describe (loss
falling as a power of the tokens, noise scale ``B* / L^(1/0.21)`` tokens, Kaplan et al. 2020, optionally
scaled), trained to the loss the trace reaches at its end. The candidates are the fastest strategy of each gbs
of the doubling frontier (predicted by the performance model); every static candidate, the hindsight optimum
(DP with the switch cost) and CONA's online chain are timed on the same progress axis
(:mod:`cona.planner.plan`). Ratios are against the optimum of the same scenario.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, replace

from cona.config import ConaConfig, ModelConfig, TrainingConfig
from cona.planner.plan import (
    DEFAULT_SEGMENTS,
    ChainPlan,
    SearchSettings,
    best_candidates,
    frontier_sizes,
    noise_profile,
    simulate,
    target_progress,
)
from cona.planner.policy import PolicySettings
from cona.planner.systems import load_system
from cona.planner.trace import LossCurve, synthetic_trace

SEQ = 2048
MODELS = {
    "gpt-1.3b": ModelConfig(name="gpt-1.3b", layers=24, hidden=2048, heads=16, seq=SEQ, vocab_size=50257),
    "gpt-6.7b": ModelConfig(name="gpt-6.7b", layers=32, hidden=4096, heads=32, seq=SEQ, vocab_size=50257),
    "gpt-13b": ModelConfig(name="gpt-13b", layers=40, hidden=5120, heads=40, seq=SEQ, vocab_size=50257),
    "gpt-175b": ModelConfig(name="gpt-175b", layers=96, hidden=12288, heads=96, seq=SEQ, vocab_size=50257),
}


@dataclass(frozen=True, kw_only=True)
class Scenario:
    model: str
    system: str
    gpus: int
    initial_gbs: int
    max_gbs: int
    tokens: float
    """Training length of the trace (the target is the loss it reaches at the end)."""
    loss_floor: float
    switch_cost_s: float
    noise_multiplier: float = 1.0


PAPER = Scenario(  # the paper's setting: 16 A6000s in two nodes over 100 GbE
    model="gpt-1.3b",
    system="a6000_48g_pcie",
    gpus=16,
    initial_gbs=16,
    max_gbs=1024,
    tokens=2.6e10,
    loss_floor=2.0,
    switch_cost_s=60,
)
GPT_13B = Scenario(
    model="gpt-13b",
    system="a100_80g_2gpu_node",
    gpus=512,
    initial_gbs=512,
    max_gbs=16384,
    tokens=2.6e11,
    loss_floor=1.8,
    switch_cost_s=180,
)
GPT_175B = Scenario(
    model="gpt-175b",
    system="h100_80g",
    gpus=4096,
    initial_gbs=512,
    max_gbs=16384,
    tokens=3e11,
    loss_floor=1.6,
    switch_cost_s=600,
)
MODEL_ERRORS = (-0.2, -0.1, 0.0, 0.1, 0.2)
"""Relative errors of the frontier's predicted throughput for the sensitivity table."""
SCENARIOS = (
    PAPER,
    replace(PAPER, switch_cost_s=600),
    replace(PAPER, noise_multiplier=4.0),
    replace(PAPER, gpus=64, initial_gbs=64, max_gbs=4096),
    replace(PAPER, system="a100_80g", gpus=64, initial_gbs=64, max_gbs=4096),
    replace(PAPER, model="gpt-6.7b", gpus=64, initial_gbs=64, max_gbs=4096, tokens=1.3e11, loss_floor=1.9),
    GPT_13B,
    replace(GPT_13B, system="h100_80g", gpus=1024, noise_multiplier=4.0),
    GPT_175B,
    replace(GPT_175B, noise_multiplier=4.0),
)


def prepared(scenario: Scenario, botorch: bool):
    """The scenario's candidates (best strategy per frontier gbs), noise profile and policy settings."""
    config = ConaConfig(model=MODELS[scenario.model], training=TrainingConfig(base_gbs=scenario.initial_gbs))
    curve = LossCurve(floor=scenario.loss_floor, scale_tokens=scenario.tokens / 1000)
    trace = synthetic_trace(
        seq=SEQ,
        gbs=scenario.initial_gbs,
        total_tokens=scenario.tokens,
        curve=curve,
        noise_multiplier=scenario.noise_multiplier,
    )
    search = SearchSettings(system=load_system(scenario.system), n_gpus=scenario.gpus, botorch=botorch)
    policy = PolicySettings(base_gbs=scenario.initial_gbs, max_gbs=scenario.max_gbs)
    candidates = best_candidates(config, frontier_sizes(scenario.initial_gbs, policy), search)
    profile = noise_profile(
        trace, scenario.initial_gbs, target_progress(trace, scenario.initial_gbs), DEFAULT_SEGMENTS
    )
    return trace, candidates, profile, policy


def label(scenario: Scenario) -> str:
    return (
        f"{scenario.model} {scenario.system} x{scenario.gpus} noise x{scenario.noise_multiplier:g} "
        f"cost {scenario.switch_cost_s:g} s"
    )


def gbs_chain(plan: ChainPlan) -> str:
    return "->".join(str(stage.strategy.gbs) for stage in plan.stages)


def comparison(botorch: bool) -> None:
    print(
        f"{'scenario':58s} {'loss':>5s} {'phi_end':>7s} {'opt h':>8s} {'CONA':>7s} {'best static':>17s} "
        f"{'worst static':>18s}  optimum chain / CONA chain"
    )
    regrets = []
    for scenario in SCENARIOS:
        started = time.perf_counter()
        trace, candidates, profile, policy = prepared(scenario, botorch)
        result = simulate(candidates, profile, policy=policy, switch_cost_s=scenario.switch_cost_s, seq=SEQ)
        seconds = time.perf_counter() - started
        optimum = result.optimum.time_s
        regrets.append(result.online.time_s / optimum - 1.0)
        best, worst = result.best_static, result.worst_static
        print(
            f"{label(scenario):58s} {trace.loss[-1]:5.2f} {profile.noise_scale[-1]:7.0f} "
            f"{optimum / 3600:8.2f} "
            f"{result.online.time_s / optimum:6.4f}x "
            f"{best.time_s / optimum:7.4f}x (gbs {best.stages[0].strategy.gbs:5d}) "
            f"{worst.time_s / optimum:7.3f}x (gbs {worst.stages[0].strategy.gbs:5d})  "
            f"{gbs_chain(result.optimum)} / {gbs_chain(result.online)}  [{seconds:.1f} s]"
        )
    mean = sum(regrets) / len(regrets)
    print(
        f"\nCONA vs the hindsight optimum over {len(regrets)} scenarios: "
        f"mean {mean:+.3%}, worst {max(regrets):+.3%}"
    )


def model_error_sensitivity(botorch: bool) -> None:
    """CONA told frontier throughputs off by a factor (the running strategy is measured exactly)."""
    print(f"\n{'scenario':58s} " + " ".join(f"{f'err {error:+.0%}':>10s}" for error in MODEL_ERRORS))
    for scenario in (PAPER, replace(GPT_175B, noise_multiplier=4.0)):
        _, candidates, profile, policy = prepared(scenario, botorch)
        cells = []
        for error in MODEL_ERRORS:
            believed = tuple(
                replace(c, predicted_tokens_per_s=c.predicted_tokens_per_s * (1 + error)) for c in candidates
            )
            result = simulate(
                candidates,
                profile,
                policy=policy,
                switch_cost_s=scenario.switch_cost_s,
                seq=SEQ,
                believed=believed,
            )
            cells.append(f"{result.online.time_s / result.optimum.time_s:9.4f}x")
        print(f"{label(scenario):58s} " + " ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument(
        "--botorch", action="store_true", help="Bayesian frontier search instead of exhaustive"
    )
    args = parser.parse_args()
    comparison(args.botorch)
    model_error_sensitivity(args.botorch)


if __name__ == "__main__":
    main()
