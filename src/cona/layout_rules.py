"""The one set of layout rules: which strategies the engine can train; the engine, planner and runner use it.

Each rule is written once, over the columns of a :class:`~cona.strategy.StrategyArray`; one strategy is
checked as an array of one row, so the engine's check of one strategy and the planner's mask over millions
cannot disagree. The rules state what the engine runs:

- every degree and batch size positive; dp * tp * pp = the processes launched (when that is known);
- tp divides every tensor-sharded size: attention heads, key/value heads (a rank holds whole heads), the
  feed-forward width and the padded vocabulary; with sequence parallelism also the sequence length;
- gbs a multiple of mbs * dp;
- with a pipeline (pp > 1; with pp = 1 the schedule settings are ignored, so one config serves every
  strategy of a chain): more than one virtual stage needs interleaved 1F1B; at least one block per stage
  (layers >= pp * virtual_stages: :func:`cona.engine.pipeline.stage_layer_ids` splits unevenly where
  needed); 1F1B and interleaved 1F1B at least pp micro-batches per step (GPipe any number); interleaved
  1F1B a micro-batch count that is a multiple of its rounds, ``max(1, micro_batches // pp)`` (the condition
  of ``torch.distributed.pipelining.ScheduleInterleaved1F1B``).

The planner's search space proposes a narrower set on purpose (even stages; see :mod:`cona.planner.space`)
but never anything these rules refuse.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from cona.config import ModelConfig
from cona.errors import LayoutError
from cona.strategy import SCHEDULE_CODES, Strategy, StrategyArray

POSITIVE_FIELDS = ("dp", "tp", "pp", "mbs", "gbs", "virtual_stages")
ZERO_STAGES = (0, 1, 2, 3)
TP_SHARDED_SIZES = ("heads", "kv_heads", "ffn", "vocab")
"""The model sizes tensor parallelism splits across its ranks."""
INTERLEAVED, GPIPE = SCHEDULE_CODES["interleaved_1f1b"], SCHEDULE_CODES["gpipe"]


class _Shape(Protocol):
    """The sizes of :class:`cona.planner.flops.ModelShape` the rules read."""

    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int


@dataclass(frozen=True, kw_only=True)
class LayoutSizes:
    """The model sizes the rules read, with how a message names each (the config key for a config)."""

    layers: int
    heads: int
    kv_heads: int
    ffn: int
    """Feed-forward hidden size."""
    vocab: int
    """Padded vocabulary."""
    seq: int
    labels: Mapping[str, str]
    """Per size, the text a message shows for it, e.g. ``model.heads=16``."""

    @classmethod
    def of_config(cls, model: ModelConfig) -> LayoutSizes:
        """The sizes of a model config; messages name its keys."""
        vocab = model.padded_vocab_size
        labels = {
            "layers": f"model.layers={model.layers}",
            "heads": f"model.heads={model.heads}",
            "kv_heads": f"model.kv_heads={model.kv_heads} (a rank holds whole key/value heads)",
            "ffn": f"the feed-forward size {model.ffn_size} (model.ffn_hidden)",
            "vocab": (
                f"the padded vocabulary {vocab} "
                f"(model.make_vocab_size_divisible_by={model.make_vocab_size_divisible_by})"
            ),
            "seq": f"model.seq={model.seq}",
        }
        return cls(
            layers=model.layers,
            heads=model.heads,
            kv_heads=model.kv_heads,
            ffn=model.ffn_size,
            vocab=vocab,
            seq=model.seq,
            labels=labels,
        )

    @classmethod
    def of_shape(cls, shape: _Shape) -> LayoutSizes:
        """The sizes of the planner's model shape; messages name its fields."""
        names = {"layers": "layers", "heads": "heads", "kv_heads": "kv_heads", "ffn": "ffn_hidden"}
        names |= {"vocab": "padded vocab", "seq": "seq"}
        values = {key: getattr(shape, key) for key in names}
        return cls(**values, labels={key: f"{name}={values[key]}" for key, name in names.items()})


def _at_least_one(column: np.ndarray) -> np.ndarray:
    """A degree clamped to 1, so a rule can divide by it (a non-positive one fails the positivity rules)."""
    return np.maximum(column, 1)


def _micro_batches(s: StrategyArray) -> np.ndarray:
    return s.gbs // (_at_least_one(s.mbs) * _at_least_one(s.dp))


def tensor_parallel_fits(sizes: LayoutSizes, tp: np.ndarray | int) -> np.ndarray:
    """Whether ``tp`` divides every size tensor parallelism shards (the rules of :data:`RULES` on tp)."""
    tp = _at_least_one(np.asarray(tp))
    return np.logical_and.reduce([getattr(sizes, key) % tp == 0 for key in TP_SHARDED_SIZES])


Check = Callable[[StrategyArray, LayoutSizes, "int | None"], np.ndarray]
Explain = Callable[[Strategy, LayoutSizes, "int | None"], str]


@dataclass(frozen=True)
class Rule:
    """One condition a layout must meet: ``holds`` over a strategy array, ``why`` for one failing strategy."""

    holds: Check
    why: Explain


def _positive(name: str) -> Rule:
    return Rule(
        holds=lambda s, sizes, world: getattr(s, name) >= 1,
        why=lambda strategy, sizes, world: f"{name} must be positive, got {getattr(strategy, name)}",
    )


def _tp_divides(key: str) -> Rule:
    return Rule(
        holds=lambda s, sizes, world: getattr(sizes, key) % _at_least_one(s.tp) == 0,
        why=lambda strategy, sizes, world: f"tp={strategy.tp} does not divide {sizes.labels[key]}",
    )


def _pipelined(s: StrategyArray) -> np.ndarray:
    return s.pp > 1


POSITIVITY = tuple(_positive(name) for name in POSITIVE_FIELDS)
RULES: tuple[Rule, ...] = (
    Rule(
        holds=lambda s, sizes, world: np.full(len(s), True) if world is None else s.dp * s.tp * s.pp == world,
        why=lambda st, sizes, world: f"dp*tp*pp = {st.world_size} processes, but {world} were launched",
    ),
    Rule(
        holds=lambda s, sizes, world: np.isin(s.zero_stage, ZERO_STAGES),
        why=lambda st, sizes, world: f"zero_stage {st.zero_stage} is not one of 0, 1, 2, 3",
    ),
    *(_tp_divides(key) for key in TP_SHARDED_SIZES),
    Rule(
        holds=lambda s, sizes, world: (
            ~s.sequence_parallel.astype(bool) | (sizes.seq % _at_least_one(s.tp) == 0)
        ),
        why=lambda st, sizes, world: f"sequence parallel needs tp={st.tp} to divide {sizes.labels['seq']}",
    ),
    Rule(
        holds=lambda s, sizes, world: s.gbs % (_at_least_one(s.mbs) * _at_least_one(s.dp)) == 0,
        why=lambda st, sizes, world: f"gbs={st.gbs} is not a multiple of mbs*dp={st.mbs * st.dp}",
    ),
    Rule(
        holds=lambda s, sizes, world: (
            ~_pipelined(s) | (s.virtual_stages == 1) | (s.pipeline_schedule == INTERLEAVED)
        ),
        why=lambda st, sizes, world: (
            f"virtual_stages={st.virtual_stages} needs the interleaved_1f1b schedule, "
            f"not {st.pipeline_schedule}"
        ),
    ),
    Rule(
        holds=lambda s, sizes, world: ~_pipelined(s) | (sizes.layers >= s.pp * s.virtual_stages),
        why=lambda st, sizes, world: (
            f"{sizes.labels['layers']} is fewer than pp*virtual_stages={st.pp * st.virtual_stages} "
            "pipeline stages"
        ),
    ),
    Rule(
        holds=lambda s, sizes, world: (
            ~_pipelined(s) | (s.pipeline_schedule == GPIPE) | (_micro_batches(s) >= s.pp)
        ),
        why=lambda st, sizes, world: (
            f"{st.pipeline_schedule} needs at least pp={st.pp} micro-batches per step, "
            f"got gbs/(mbs*dp)={st.micro_batches}"
        ),
    ),
    Rule(
        holds=lambda s, sizes, world: (
            ~_pipelined(s)
            | (s.pipeline_schedule != INTERLEAVED)
            | (_micro_batches(s) % np.maximum(1, _micro_batches(s) // _at_least_one(s.pp)) == 0)
        ),
        why=lambda st, sizes, world: (
            f"interleaved_1f1b needs the {st.micro_batches} micro-batches to be a multiple of "
            f"{max(1, st.micro_batches // st.pp)} rounds (micro-batches // pp); use a multiple of pp={st.pp}"
        ),
    ),
)
"""The rules after positivity, in the order a message reports the first failure."""


def layout_mask(sizes: LayoutSizes, strategies: StrategyArray, world_size: int | None = None) -> np.ndarray:
    """Which of ``strategies`` the engine can train (on ``world_size`` processes, when given)."""
    ok = np.full(len(strategies), True)
    for rule in (*POSITIVITY, *RULES):
        ok &= rule.holds(strategies, sizes, world_size)
    return ok


def layout_failures(sizes: LayoutSizes, strategy: Strategy, world_size: int | None = None) -> list[str]:
    """Why the engine cannot train ``strategy``, one reason per failed rule (empty when it can). A
    non-positive size or degree is reported alone: the other rules say nothing sensible about it."""
    row = StrategyArray.from_strategies([strategy])
    for rules in (POSITIVITY, RULES):
        failed = [
            rule.why(strategy, sizes, world_size)
            for rule in rules
            if not rule.holds(row, sizes, world_size)[0]
        ]
        if failed:
            return failed
    return []


def check_layout(sizes: LayoutSizes, strategy: Strategy, world_size: int | None = None) -> None:
    """Raise :class:`LayoutError` with the first reason the engine cannot train ``strategy``."""
    failures = layout_failures(sizes, strategy, world_size)
    if failures:
        raise LayoutError(f"strategy {strategy.short()}: {failures[0]}")
