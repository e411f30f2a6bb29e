"""A cluster's answer from measured curves: the candidates the search finds there, the world they make with
the curves, and the policy settings online mode would run with (:mod:`cona.planner.simulate` compares).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from cona.config import ModelConfig, TrainingConfig
from cona.errors import PlanError
from cona.planner.curves import StatCurves
from cona.planner.policy import Candidate, PolicySettings
from cona.planner.profiles import BackendProfile
from cona.planner.search_choice import search_strategies
from cona.planner.simulate import World, build_world
from cona.planner.space import SpaceOptions
from cona.planner.switch_cost import IN_PLACE_S, predicted_switch_cost_s
from cona.planner.systems import System


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """Where the plan is for: a system file, a GPU count, the dtype and the backend whose profile predicts."""

    system: System
    gpus: int
    dtype: str = "bf16"
    backend: str | BackendProfile = "native"
    botorch: bool | None = None
    options: SpaceOptions | None = None
    """The options searched besides the layout (:func:`cona.planner.plan.space_options` gives online mode's:
    the config's ZeRO stage, recompute and sequence parallelism); None: every option."""


def cluster_candidates(model: ModelConfig, cluster: Cluster, sizes: tuple[int, ...]) -> tuple[Candidate, ...]:
    """The model's fastest strategy that fits at each gbs of ``sizes`` (a gbs where none fits is left out)."""
    dtype = cluster.system.resolve_dtype(cluster.dtype)
    candidates = []
    for gbs in sizes:
        try:
            result = search_strategies(
                model, cluster.system, cluster.gpus, gbs, dtype=dtype, top_k=1, backend=cluster.backend,
                botorch=cluster.botorch, options=cluster.options,
            )  # fmt: skip
        except PlanError:
            continue
        candidates.append(
            Candidate(strategy=result.best, predicted_tokens_per_s=float(result.prediction.tokens_per_s[0]))
        )
    return tuple(candidates)


def policy_settings(
    curves: StatCurves, max_gbs: int, training: TrainingConfig | None = None
) -> PolicySettings:
    """Online mode's settings (the config's policy keys and log interval; defaults when none is given) over
    the curves' gbs, switching in place where the layout is kept, as the native engine does."""
    training = training or TrainingConfig(base_gbs=curves.base_gbs)
    return PolicySettings.from_training(
        training, max_gbs=max_gbs, gbs_list=curves.gbs, in_place=True, predicted_in_place_cost_s=IN_PLACE_S
    )


def curves_world(
    curves: StatCurves,
    cluster: Cluster,
    *,
    initial_gbs: int,
    max_gbs: int,
    target_loss: float,
    segments: int,
) -> World:
    """The simulated world of ``curves`` on ``cluster``, from ``initial_gbs`` up to ``max_gbs``."""
    sizes = tuple(g for g in curves.gbs if initial_gbs <= g <= max_gbs)
    if initial_gbs not in curves.gbs:
        raise PlanError(
            f"--initial-gbs: {curves.source} has no curve at gbs {initial_gbs} "
            f"(it has {', '.join(map(str, curves.gbs))})"
        )
    candidates = cluster_candidates(curves.model, cluster, sizes)
    if not candidates:
        raise PlanError(
            f"no strategy of {curves.model.name} fits {cluster.gpus} GPUs of {cluster.system.name}"
        )
    fitted = {c.strategy.gbs for c in candidates}
    no_fit = tuple(f"gbs {gbs}: no strategy fits" for gbs in sizes if gbs not in fitted)
    per_node = cluster.system.gpus_per_node
    world = build_world(
        curves,
        candidates,
        target_loss=target_loss,
        segments=segments,
        initial_gbs=initial_gbs,
        switch_cost=lambda a, b: predicted_switch_cost_s(curves.model, a.strategy, b.strategy, per_node),
    )
    return dataclasses.replace(world, left_out=no_fit + world.left_out)
