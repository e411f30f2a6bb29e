"""Search logic on a known objective (a stand-in for the performance model), then on the real model."""

import sys
from dataclasses import dataclass

import numpy as np
import pytest

from cona.config import ModelConfig
from cona.errors import PlanError
from cona.planner import local_search, search
from cona.planner.search import bayesian_search, encode, exhaustive_search
from cona.planner.space import SpaceOptions, enumerate_strategies
from cona.planner.systems import load_system

GPT_1_3B = ModelConfig(layers=24, hidden=2048, heads=16, seq=2048, vocab_size=50257)
SMALL_SPACE = SpaceOptions(zero_stages=(1, 3), recompute=("none", "full"), sequence_parallel=(False,))


@dataclass(frozen=True)
class KnownPrediction:
    iteration_time_s: np.ndarray
    memory_gib: np.ndarray
    oom: np.ndarray
    tokens_per_s: np.ndarray
    note: str = "per-strategy arrays above, a scalar here"


class KnownModel:
    """A smooth objective, optimum at tp 2, mbs 4, no recompute; counts its calls.

    Memory is scaled so that a strategy fits exactly when its unscaled memory is under ``memory_limit_gib``,
    under perf_model's rule (memory plus the system's reserved memory within the GPU's memory).
    """

    def __init__(self, memory_limit_gib: float = 60.0):
        self.memory_limit_gib = memory_limit_gib
        self.calls: list[int] = []

    def __call__(self, model, strategies, system, *, dtype="bf16", calibration=None, backend="native"):
        self.calls.append(len(strategies))
        time = (
            1.0
            + 0.3 * np.abs(np.log2(strategies.tp) - 1)
            + 0.2 * np.abs(np.log2(strategies.mbs) - 2)
            + 0.15 * strategies.recompute
            + 0.05 * strategies.pp
            + 0.01 * strategies.zero_stage
            + 0.02 * (strategies.virtual_stages - 1)
        )
        usable = system.gpu.memory_gib - system.gpu.reserved_gib
        memory = (
            400.0
            * usable
            / self.memory_limit_gib
            * strategies.mbs
            / (strategies.tp * strategies.pp * (1 + strategies.zero_stage) * (1 + 2 * strategies.recompute))
        )
        return KnownPrediction(
            iteration_time_s=time,
            memory_gib=memory,
            oom=memory + system.gpu.reserved_gib > system.gpu.memory_gib,
            tokens_per_s=strategies.gbs * 2048 / time,
        )


@pytest.fixture
def known_model(monkeypatch):
    fake = KnownModel()
    monkeypatch.setattr(search, "predict", fake)
    return fake


@pytest.fixture(scope="module")
def a100():
    return load_system("a100_80g")


def brute_force_best(fake, a100, n_gpus=16, gbs=64):
    space = enumerate_strategies(GPT_1_3B, n_gpus, gbs, gpus_per_node=a100.gpus_per_node, options=SMALL_SPACE)
    prediction = fake(GPT_1_3B, space, a100)
    time = np.where(prediction.oom, np.inf, prediction.iteration_time_s)
    return space[int(np.argmin(time))], float(time.min()), len(space)


def test_exhaustive_ranks_every_fitting_strategy(known_model, a100):
    result = exhaustive_search(GPT_1_3B, a100, 16, 64, options=SMALL_SPACE, top_k=5)
    best, best_time, size = brute_force_best(KnownModel(), a100)
    assert result.best == best
    assert result.prediction.iteration_time_s[0] == pytest.approx(best_time)
    assert np.all(np.diff(result.prediction.iteration_time_s) >= 0)
    assert not result.prediction.oom.any()
    assert len(result.candidates) == 5 and result.evaluations == result.space_size == size
    assert known_model.calls == [size]  # one vectorised call
    recomputed = KnownModel()(GPT_1_3B, result.candidates, a100)
    assert np.array_equal(
        recomputed.iteration_time_s, result.prediction.iteration_time_s
    )  # rows stay aligned
    assert result.prediction.note == KnownPrediction.note


@pytest.mark.slow  # about 10 GP fits: 10-30 s on a shared 2-core machine
def test_bayesian_search_finds_the_optimum_with_few_evaluations(known_model, a100):
    result = bayesian_search(GPT_1_3B, a100, 16, 64, options=SMALL_SPACE, top_k=3, seed=1, max_gp_updates=12)
    best, best_time, size = brute_force_best(KnownModel(), a100)
    assert result.prediction.iteration_time_s[0] <= best_time * 1.02
    assert result.evaluations < size / 2
    # Each evaluation is one single-strategy call; the last call gathers the winners' rows (not counted).
    assert known_model.calls[:-1] == [1] * result.evaluations
    assert known_model.calls[-1] == len(result.candidates)
    assert np.all(np.diff(result.prediction.iteration_time_s) >= 0) and not result.prediction.oom.any()


def test_bayesian_search_is_deterministic(known_model, a100):
    settings = {"options": SMALL_SPACE, "seed": 3, "max_gp_updates": 1, "max_local_rounds": 0}
    first = bayesian_search(GPT_1_3B, a100, 16, 64, **settings)
    second = bayesian_search(GPT_1_3B, a100, 16, 64, **settings)
    assert first.evaluations == second.evaluations == search.BOOTSTRAP_SAMPLES + 1
    assert [first.candidates[i] for i in range(len(first.candidates))] == [
        second.candidates[i] for i in range(len(second.candidates))
    ]


def test_bootstrap_covers_every_layout_first():
    space = enumerate_strategies(GPT_1_3B, 16, 64, gpus_per_node=8, options=SMALL_SPACE)
    order = search.bootstrap_order(space, np.random.default_rng(0))
    layouts = set(zip(space.tp.tolist(), space.pp.tolist(), strict=True))
    first = order[: len(layouts)]
    assert set(zip(space.tp[first].tolist(), space.pp[first].tolist(), strict=True)) == layouts
    assert sorted(order.tolist()) == list(range(len(space)))


def test_bootstrap_only_and_settings_overrides(known_model, a100):
    result = bayesian_search(
        GPT_1_3B, a100, 16, 64, options=SMALL_SPACE, bootstrap_samples=7, max_gp_updates=0, max_local_rounds=0
    )
    assert result.evaluations == 7
    assert len(result.evaluated) == 7 and result.best in [result.evaluated[i] for i in range(7)]
    with pytest.raises(PlanError, match="bootstrap"):
        bayesian_search(GPT_1_3B, a100, 16, 64, bootstrap_samples=0)


def test_ei_stop_rule_ends_the_search_early(known_model, a100):
    # A huge stop fraction stops at the first GP update whose best EI is below it.
    result = bayesian_search(
        GPT_1_3B,
        a100,
        16,
        64,
        options=SMALL_SPACE,
        bootstrap_samples=8,
        ei_stop_fraction=10.0,
        max_gp_updates=30,
        max_local_rounds=0,
    )
    assert result.evaluations == 8


def test_nothing_fits_is_a_one_line_error(monkeypatch, a100):
    monkeypatch.setattr(search, "predict", KnownModel(memory_limit_gib=0.001))
    with pytest.raises(PlanError, match="fits in the memory of") as error:
        exhaustive_search(GPT_1_3B, a100, 16, 64, options=SMALL_SPACE)
    assert "\n" not in str(error.value)
    with pytest.raises(PlanError, match="of the strategies the search evaluated"):
        bayesian_search(GPT_1_3B, a100, 16, 64, options=SMALL_SPACE, max_gp_updates=2)


def test_search_moves_towards_the_feasible_region_when_nothing_fits_yet(monkeypatch, a100):
    # Under 3 GiB only a few low-memory corners fit (tp x pp >= 8, ZeRO 3 or full recompute, mbs 1); the
    # bootstrap misses them, and the memory constraint must lead there.
    fake = KnownModel(memory_limit_gib=3.0)
    monkeypatch.setattr(search, "predict", fake)
    space = enumerate_strategies(GPT_1_3B, 16, 64, gpus_per_node=8, options=SMALL_SPACE)
    bootstrap = space.select(search.bootstrap_order(space, np.random.default_rng(0))[:3])
    assert fake(GPT_1_3B, bootstrap, a100).oom.all()
    result = bayesian_search(
        GPT_1_3B, a100, 16, 64, options=SMALL_SPACE, bootstrap_samples=3, seed=0, max_gp_updates=4
    )
    assert not result.prediction.oom.any()


def test_neighbours_step_one_option_and_repair_invalid_steps():
    space = enumerate_strategies(GPT_1_3B, 16, 64, gpus_per_node=8, options=SMALL_SPACE)
    ranks = local_search.option_ranks(space)
    center = int(np.flatnonzero((space.tp == 2) & (space.pp == 1) & (space.mbs == 2) & (space.zero_stage == 1)
                                & (space.recompute == 0))[0])  # fmt: skip
    found = [space[int(i)] for i in local_search.neighbours(ranks, center)]
    assert space[center] not in found
    steps = {(s.tp, s.pp, s.mbs, s.zero_stage, s.recompute) for s in found}
    # tp 1 and 4 (dp follows), pp 2, mbs 1 and 4, ZeRO 3, full recompute: one option changed each.
    assert steps == {(1, 1, 2, 1, "none"), (4, 1, 2, 1, "none"), (2, 2, 2, 1, "none"), (2, 1, 1, 1, "none"),
                     (2, 1, 4, 1, "none"), (2, 1, 2, 3, "none"), (2, 1, 2, 1, "full")}  # fmt: skip
    # From pp 1 there is no virtual stage > 1: the step to v 2 is repaired with the smallest other change.
    interleaved = [s for s in found if s.virtual_stages > 1]
    assert all(s.pp > 1 for s in interleaved)


def test_local_refinement_climbs_to_the_optimum_without_the_gp(monkeypatch, a100):
    # No GP update at all: on an objective that is unimodal along each option (everything fits), the layout
    # sweep and hill climb alone must walk from the bootstrap's best to the optimum, one strategy per call.
    fake = KnownModel(memory_limit_gib=1e9)
    monkeypatch.setattr(search, "predict", fake)
    result = bayesian_search(
        GPT_1_3B, a100, 16, 64, options=SMALL_SPACE, bootstrap_samples=3, max_gp_updates=0, seed=0
    )
    best, best_time, size = brute_force_best(KnownModel(memory_limit_gib=1e9), a100)
    assert result.best == best
    assert result.evaluations < size / 3
    assert fake.calls[:-1] == [1] * result.evaluations


def test_layout_sweep_carries_the_options_to_every_layout():
    space = enumerate_strategies(GPT_1_3B, 16, 64, gpus_per_node=8, options=SMALL_SPACE)
    ranks = local_search.option_ranks(space)
    center = int(np.flatnonzero((space.tp == 2) & (space.pp == 1) & (space.mbs == 2) & (space.zero_stage == 3)
                                & (space.recompute == 2))[0])  # fmt: skip
    sweep = [space[int(i)] for i in local_search.layout_representatives(space, ranks, center)]
    layouts = set(zip(space.tp.tolist(), space.pp.tolist(), strict=True))
    assert sorted((s.tp, s.pp) for s in sweep) == sorted(layouts)  # one per layout
    assert space[center] in sweep
    # Wherever the layout allows them (dp > 1 for ZeRO 3), the options are the center's.
    same = [s for s in sweep if (s.tp, s.pp) in {(1, 1), (4, 2), (8, 1)}]
    assert len(same) == 3
    assert all((s.mbs, s.zero_stage, s.recompute) == (2, 3, "full") for s in same)


def test_local_refinement_respects_its_round_limit(known_model, a100):
    space = enumerate_strategies(GPT_1_3B, 16, 64, gpus_per_node=8, options=SMALL_SPACE)
    layouts = len(set(zip(space.tp.tolist(), space.pp.tolist(), strict=True)))
    one_round = bayesian_search(
        GPT_1_3B, a100, 16, 64, options=SMALL_SPACE, bootstrap_samples=3, max_gp_updates=0, max_local_rounds=1
    )
    # The layout sweep, then at most one step along each of the 7 options in each direction.
    assert 3 < one_round.evaluations <= 3 + layouts + 7 * 2
    assert one_round.refinement_evaluations == one_round.evaluations - 3
    with pytest.raises(PlanError, match="local rounds"):
        bayesian_search(GPT_1_3B, a100, 16, 64, max_local_rounds=-1)


def test_encoding_is_scaled_and_distinct():
    space = enumerate_strategies(GPT_1_3B, 16, 64, gpus_per_node=8, options=SMALL_SPACE)
    features = encode(space)
    assert features.min() >= 0.0 and features.max() <= 1.0
    assert len(np.unique(features, axis=0)) == len(space)


def test_exhaustive_search_with_the_performance_model(a100):
    result = exhaustive_search(GPT_1_3B, a100, 64, 512, top_k=10)
    times = result.prediction.iteration_time_s
    assert len(result.candidates) == 10 and np.all(np.diff(times) >= 0)
    assert not result.prediction.oom.any()
    space = enumerate_strategies(GPT_1_3B, 64, 512, gpus_per_node=a100.gpus_per_node)
    full = search.predict(GPT_1_3B, space, a100)
    assert times[0] == pytest.approx(full.iteration_time_s[~full.oom].min())


def test_missing_botorch_is_a_one_line_error(monkeypatch, a100):
    monkeypatch.setitem(sys.modules, "botorch", None)  # makes `import botorch` raise ImportError
    with pytest.raises(PlanError, match="--no-botorch"):
        bayesian_search(GPT_1_3B, a100, 16, 64, options=SMALL_SPACE)
