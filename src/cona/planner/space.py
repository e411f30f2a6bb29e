"""Every parallel strategy the planner proposes for a model on N GPUs at one gbs (vectorised with numpy).

Every strategy proposed is one the engine can train (:mod:`cona.layout_rules`, applied to the whole space
at the end): ``dp * tp * pp = N``, tp divides the heads, key/value heads, FFN width and padded vocabulary
(and, with sequence parallelism, the sequence), ``gbs`` is a multiple of ``mbs * dp``. The space is
narrower than those rules on purpose: pp divides the layers (equal stages: the engine also runs uneven
ones, but the slowest stage sets the pace), every schedule gets at least ``pp`` micro-batches (fewer leave
pipeline stages idle for the whole step), and interleaved 1F1B with ``v`` virtual stages needs ``v`` to
divide the layers per stage and, as in Megatron-LM, the micro-batch count to be a multiple of ``pp``. tp
stays within a node unless ``allow_cross_node_tp`` (its all-reduces sit on the critical path of every
layer). Sequence parallelism is only listed with ``tp > 1``, and with ``dp = 1`` only the lowest ZeRO stage
(the others are the same thing there).

The space is built as a product of small option arrays followed by boolean masks, never as a Python loop over
the product, so 4096 GPUs cost milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from cona.config import ModelConfig
from cona.errors import PlanError
from cona.layout_rules import LayoutSizes, layout_mask, tensor_parallel_fits
from cona.planner.perf_model import predict
from cona.planner.systems import System
from cona.strategy import RECOMPUTE_CODES, SCHEDULE_CODES, StrategyArray

if TYPE_CHECKING:
    from cona.planner.calibration_factors import Calibration


@dataclass(frozen=True, kw_only=True, slots=True)
class SpaceOptions:
    """Which execution options the space varies besides (dp, tp, pp, mbs)."""

    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    """ZeRO/FSDP stages to consider (0: replicated, 1: optimizer sharded, 2: + grads, 3: + weights)."""
    recompute: tuple[str, ...] = ("none", "selective", "full")
    """Activation recomputation modes to consider."""
    sequence_parallel: tuple[bool, ...] = (False, True)
    """Sequence-parallel settings to consider (True only applies with tp > 1)."""
    interleave: bool = True
    """Also consider interleaved 1F1B with more than one virtual stage per pipeline rank."""
    max_virtual_stages: int | None = None
    """Upper bound of the virtual stages per pipeline rank (None: any divisor of the layers per stage)."""
    max_mbs: int | None = None
    """Upper bound of the micro-batch size (None: any divisor of gbs / dp)."""
    allow_cross_node_tp: bool = False
    """Let tensor parallelism span nodes."""

    def __post_init__(self) -> None:
        if not self.zero_stages or any(stage not in (0, 1, 2, 3) for stage in self.zero_stages):
            raise PlanError(f"zero stages must be a non-empty subset of 0, 1, 2, 3, got {self.zero_stages}")
        unknown = [mode for mode in self.recompute if mode not in RECOMPUTE_CODES]
        if not self.recompute or unknown:
            raise PlanError(
                f"recompute modes must be a non-empty subset of {', '.join(RECOMPUTE_CODES)}, "
                f"got {self.recompute}"
            )
        if not self.sequence_parallel:
            raise PlanError("sequence_parallel options must not be empty")
        for name in ("max_virtual_stages", "max_mbs"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise PlanError(f"{name} must be at least 1, got {value}")


def divisors(n: int) -> np.ndarray:
    """Divisors of ``n`` in increasing order."""
    candidates = np.arange(1, n + 1, dtype=np.int64)
    return candidates[n % candidates == 0]


def enumerate_strategies(
    model: ModelConfig, n_gpus: int, gbs: int, *, gpus_per_node: int, options: SpaceOptions | None = None
) -> StrategyArray:
    """All valid strategies (see the module docstring); raises :class:`PlanError` when there are none."""
    options = options or SpaceOptions()
    _check_inputs(n_gpus, gbs, gpus_per_node)
    columns = _layouts(model, n_gpus, gbs, gpus_per_node, options)
    columns = _with_virtual_stages(columns, model, options)
    columns = _product(columns, "zero_stage", np.asarray(sorted(set(options.zero_stages)), dtype=np.int64))
    columns = _keep(columns, (columns["dp"] > 1) | (columns["zero_stage"] == min(options.zero_stages)))
    codes = np.asarray([RECOMPUTE_CODES[mode] for mode in dict.fromkeys(options.recompute)], dtype=np.int64)
    columns = _product(columns, "recompute", codes)
    columns = _product(
        columns, "sequence_parallel", np.asarray(sorted(set(options.sequence_parallel)), dtype=bool)
    )
    columns = _keep(columns, ~columns["sequence_parallel"] | (columns["tp"] > 1))
    interleaved = columns["virtual_stages"] > 1
    schedule = np.where(interleaved, SCHEDULE_CODES["interleaved_1f1b"], SCHEDULE_CODES["1f1b"])
    strategies = StrategyArray(
        dp=columns["dp"],
        tp=columns["tp"],
        pp=columns["pp"],
        mbs=columns["mbs"],
        gbs=np.full_like(columns["dp"], gbs),
        zero_stage=columns["zero_stage"],
        recompute=columns["recompute"],
        sequence_parallel=columns["sequence_parallel"],
        pipeline_schedule=schedule.astype(np.int64),
        virtual_stages=columns["virtual_stages"],
    )
    strategies = strategies.select(layout_mask(LayoutSizes.of_config(model), strategies, n_gpus))
    if len(strategies) == 0:
        raise PlanError(
            f"no valid strategy for {n_gpus} GPUs at gbs {gbs} with these options: sequence "
            "parallelism was required but no tp > 1 divides the sequence length"
        )
    return strategies


def _check_inputs(n_gpus: int, gbs: int, gpus_per_node: int) -> None:
    if n_gpus < 1:
        raise PlanError(f"the GPU count (--gpus) must be at least 1, got {n_gpus}")
    if gbs < 1:
        raise PlanError(f"the global batch size (--gbs) must be at least 1, got {gbs}")
    if gpus_per_node < 1:
        raise PlanError(f"GPUs per node must be at least 1, got {gpus_per_node}")


def _layouts(
    model: ModelConfig, n_gpus: int, gbs: int, gpus_per_node: int, options: SpaceOptions
) -> dict[str, np.ndarray]:
    """Valid (dp, tp, pp, mbs) rows, with their micro-batch count."""
    degrees = divisors(n_gpus)
    tp = degrees[tensor_parallel_fits(LayoutSizes.of_config(model), degrees)]
    if not options.allow_cross_node_tp:
        tp = tp[gpus_per_node % tp == 0]
    pp = degrees[model.layers % degrees == 0]
    tp_grid, pp_grid = (grid.ravel() for grid in np.meshgrid(tp, pp, indexing="ij"))
    fits = n_gpus % (tp_grid * pp_grid) == 0
    columns = {"tp": tp_grid[fits], "pp": pp_grid[fits]}
    columns["dp"] = n_gpus // (columns["tp"] * columns["pp"])
    mbs = divisors(gbs)
    if options.max_mbs is not None:
        mbs = mbs[mbs <= options.max_mbs]
    columns = _product(columns, "mbs", mbs)
    per_step = columns["mbs"] * columns["dp"]
    micro_batches = gbs // per_step
    columns = _keep(columns, (gbs % per_step == 0) & (micro_batches >= columns["pp"]))
    if len(columns["dp"]) == 0:
        node_rule = "" if options.allow_cross_node_tp else f" and the {gpus_per_node} GPUs of a node"
        raise PlanError(
            f"no valid strategy for {n_gpus} GPUs at gbs {gbs}: gbs must be a multiple of mbs x dp with at "
            f"least pp micro-batches, where dp x tp x pp = {n_gpus}, tp divides heads={model.heads} (and the "
            f"key/value heads, the FFN width, the padded vocabulary{node_rule}) and pp divides "
            f"layers={model.layers}; try a gbs that is a multiple of {n_gpus}"
        )
    columns["micro_batches"] = gbs // (columns["mbs"] * columns["dp"])
    return columns


def _with_virtual_stages(columns: dict[str, np.ndarray], model: ModelConfig, options: SpaceOptions) -> dict:
    """Add the virtual-stage count: 1 always, and >1 for interleaved 1F1B where it is valid."""
    choices = divisors(model.layers) if options.interleave else np.ones(1, dtype=np.int64)
    if options.max_virtual_stages is not None:
        choices = choices[choices <= options.max_virtual_stages]
    columns = _product(columns, "virtual_stages", choices)
    v, pp = columns["virtual_stages"], columns["pp"]
    interleave_ok = (pp > 1) & ((model.layers // pp) % v == 0) & (columns["micro_batches"] % pp == 0)
    return _keep(columns, (v == 1) | interleave_ok)


def _product(columns: dict[str, np.ndarray], name: str, values: np.ndarray) -> dict[str, np.ndarray]:
    """Cartesian product of the rows with ``values`` as a new column ``name``."""
    rows = len(next(iter(columns.values())))
    out = {key: np.repeat(column, len(values)) for key, column in columns.items()}
    out[name] = np.tile(values, rows)
    return out


def _keep(columns: dict[str, np.ndarray], mask: np.ndarray) -> dict[str, np.ndarray]:
    return {key: column[mask] for key, column in columns.items()}


def filter_by_memory(
    model: ModelConfig,
    strategies: StrategyArray,
    system: System,
    *,
    dtype: str = "bf16",
    calibration: Calibration | None = None,
) -> StrategyArray:
    """The strategies whose predicted memory per GPU (plus the system's reserved memory) fits the GPU."""
    prediction = predict(model, strategies, system, dtype=dtype, calibration=calibration)
    return strategies.select(~prediction.oom)
