"""A parallel strategy: the (dp, tp, pp, mbs, gbs) CONA chooses, plus how it is carried out.

Shared by the planner (which ranks strategies), the runner (which chains them) and the engine
(which runs one). Arrays of strategies for the vectorised planner are in :class:`StrategyArray`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Literal

import numpy as np

RECOMPUTE_CODES = {"none": 0, "selective": 1, "full": 2}
SCHEDULE_CODES = {"1f1b": 0, "gpipe": 1, "interleaved_1f1b": 2}


@dataclass(frozen=True, kw_only=True, slots=True)
class Strategy:
    """One parallel strategy. ``gbs`` and ``mbs`` count samples (sequences)."""

    dp: int
    """Data-parallel degree."""
    tp: int
    """Tensor-parallel degree."""
    pp: int
    """Pipeline-parallel degree."""
    mbs: int
    """Micro-batch size per data-parallel rank."""
    gbs: int
    """Global batch size."""
    zero_stage: int = 1
    recompute: Literal["none", "selective", "full"] = "none"
    sequence_parallel: bool = False
    pipeline_schedule: Literal["1f1b", "gpipe", "interleaved_1f1b"] = "1f1b"
    virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved 1F1B)."""

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def micro_batches(self) -> int:
        """Micro-batches per optimizer step on each data-parallel rank (gbs / (mbs * dp))."""
        return self.gbs // (self.mbs * self.dp)

    @property
    def layout(self) -> str:
        """The checkpoint layout directory name, as the original CONA scripts name it:
        ``tp<tp>_pp<pp>_dp<dp>_sp1``."""
        return f"tp{self.tp}_pp{self.pp}_dp{self.dp}_sp1"

    def short(self) -> str:
        return f"dp{self.dp}/tp{self.tp}/pp{self.pp} mbs{self.mbs} gbs{self.gbs}"

    def same_layout(self, other: Strategy, *, keep_mbs: bool = False) -> bool:
        """Whether ``other`` differs from this one in gbs and mbs at most (``keep_mbs``: in gbs at most): a
        switch between them can keep the model's sharding and optimizer state in memory (an in-place
        switch; the Megatron-DeepSpeed backend's keeps the mbs too)."""
        return replace(other, gbs=self.gbs, mbs=other.mbs if keep_mbs else self.mbs) == self


def noise_step_pieces(strategy: Strategy) -> int:
    """Equal pieces the native engine cuts each rank's micro-batch into on a step that measures the noise
    scale (1: not cut): the smallest factor > 1 of ``mbs`` where a rank has a single micro-batch a step and
    pp = 1 (a pipeline's schedule is built for one micro-batch count and shape). Equal pieces keep one
    small-batch size per step, which the estimator needs. The engine cuts by it
    (:mod:`cona.engine.step_noise`); the online search leaves such steps out of its first-line proxy."""
    if strategy.micro_batches != 1 or strategy.pp != 1:
        return 1
    return next((factor for factor in range(2, strategy.mbs + 1) if strategy.mbs % factor == 0), 1)


def configured_strategy(training: Any, *, dp: int, tp: int, pp: int, mbs: int, gbs: int) -> Strategy:
    """These degrees and batch sizes, run as the config's ``training`` section says (ZeRO stage, recompute,
    sequence parallelism, pipeline schedule and virtual stages): what a flag set or a chain step means."""
    return Strategy(
        dp=dp,
        tp=tp,
        pp=pp,
        mbs=mbs,
        gbs=gbs,
        zero_stage=training.runtime.zero_stage,
        recompute=training.runtime.recompute,
        sequence_parallel=training.runtime.sequence_parallel,
        pipeline_schedule=training.runtime.pipeline_schedule,
        virtual_stages=training.runtime.pipeline_virtual_stages,
    )


@dataclass(frozen=True, slots=True)
class StrategyArray:
    """Many strategies as parallel integer arrays (one entry per strategy), for vectorised models."""

    dp: np.ndarray
    tp: np.ndarray
    pp: np.ndarray
    mbs: np.ndarray
    gbs: np.ndarray
    zero_stage: np.ndarray
    recompute: np.ndarray
    """Codes of :data:`RECOMPUTE_CODES`."""
    sequence_parallel: np.ndarray
    """Booleans."""
    pipeline_schedule: np.ndarray
    """Codes of :data:`SCHEDULE_CODES`."""
    virtual_stages: np.ndarray

    def __len__(self) -> int:
        return int(self.dp.shape[0])

    @classmethod
    def from_strategies(cls, strategies: list[Strategy]) -> StrategyArray:
        def column(name: str, codes: dict | None = None, dtype=np.int64) -> np.ndarray:
            values = [getattr(s, name) for s in strategies]
            if codes is not None:
                values = [codes[v] for v in values]
            return np.asarray(values, dtype=dtype)

        return cls(
            dp=column("dp"),
            tp=column("tp"),
            pp=column("pp"),
            mbs=column("mbs"),
            gbs=column("gbs"),
            zero_stage=column("zero_stage"),
            recompute=column("recompute", RECOMPUTE_CODES),
            sequence_parallel=column("sequence_parallel", dtype=bool),
            pipeline_schedule=column("pipeline_schedule", SCHEDULE_CODES),
            virtual_stages=column("virtual_stages"),
        )

    def __getitem__(self, index: int) -> Strategy:
        recompute = {v: k for k, v in RECOMPUTE_CODES.items()}
        schedule = {v: k for k, v in SCHEDULE_CODES.items()}
        return Strategy(
            dp=int(self.dp[index]),
            tp=int(self.tp[index]),
            pp=int(self.pp[index]),
            mbs=int(self.mbs[index]),
            gbs=int(self.gbs[index]),
            zero_stage=int(self.zero_stage[index]),
            recompute=recompute[int(self.recompute[index])],
            sequence_parallel=bool(self.sequence_parallel[index]),
            pipeline_schedule=schedule[int(self.pipeline_schedule[index])],
            virtual_stages=int(self.virtual_stages[index]),
        )

    def select(self, mask_or_indices: np.ndarray) -> StrategyArray:
        return StrategyArray(*(getattr(self, f.name)[mask_or_indices] for f in fields(self)))
