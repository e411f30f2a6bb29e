"""Analytical iteration time and memory per GPU of GPT training under many strategies at once (pure numpy).

Per micro-batch and transformer block on one GPU: the four weight matmuls (forward, and twice that backward)
at the system's matrix rate and size-dependent efficiency; the attention score/value products (a causal flash
kernel skips the masked half; its backward does 2.5x the forward work); the elementwise kernels at the memory
bandwidth; the tensor-parallel collectives, exposed (all-reduces, or all-gathers and reduce-scatters with
sequence parallelism); recomputation (full: one more forward with its collectives; selective: the attention
core). The embedding, LM head and loss run on the last pipeline stage, which is the slowest, so the step is
``m`` times its micro-batch time plus the pipeline fill ``(pp-1)/v`` times a stage's block time (1F1B and
interleaved; GPipe has the same bubble but holds all micro-batches), plus the pipeline sends (exposed, 1/tp of
the activation each as Megatron scatters them), the data-parallel collectives that do not hide under the
backward (or forward) pass, and the optimizer (memory-bound). Memory: weights, gradients and Adam state per
ZeRO stage, activations of the micro-batches in flight, logits, plus the system's reserved memory for the OOM
check. Formulas and their sources are in docs/perf-model.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import numpy as np

from cona.config import ModelConfig
from cona.errors import PlanError
from cona.layout_rules import LayoutSizes, layout_failures, layout_mask
from cona.planner import flops
from cona.planner.flops import ModelShape, model_shape
from cona.planner.profiles import BackendProfile, backend_profile
from cona.planner.step_compute import DTYPE_BYTES, FULL_RECOMPUTE, SELECTIVE_RECOMPUTE, StepTerms
from cona.planner.systems import System, all_gather_time, all_reduce_time, group_bandwidth
from cona.strategy import SCHEDULE_CODES, Strategy, StrategyArray

if TYPE_CHECKING:
    from cona.planner.calibration_factors import Calibration

GIB = 2.0**30
GPIPE = SCHEDULE_CODES["gpipe"]
GRAD_REDUCE_BYTES = 4.0
"""Gradients are kept and reduced in fp32 (FSDP2 reduce_dtype, the ZeRO-0 all-reduce of fp32 grads)."""


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """Per-strategy arrays (one entry per strategy of the input): seconds per iteration and GiB per GPU."""

    iteration_time_s: np.ndarray
    compute_s: np.ndarray
    """Matmuls, attention, elementwise kernels and recomputation of all micro-batches on the slowest stage."""
    tp_comm_s: np.ndarray
    pp_bubble_s: np.ndarray
    pp_p2p_s: np.ndarray
    """Pipeline sends, and the tied embedding's gradient all-reduce between the first and last stage."""
    dp_comm_exposed_s: np.ndarray
    optimizer_s: np.ndarray
    overhead_s: np.ndarray
    """Calibrated fixed cost per micro-batch times the micro-batches (zero without calibration)."""
    host_bound_s: np.ndarray
    """Host dispatch beyond the device's work: ``max(0, host - device)`` (the step is the larger)."""
    host_dispatch_s: np.ndarray
    """The host's dispatch time of a step (zero on a system without asynchronous dispatch)."""
    weights_gib: np.ndarray
    grads_gib: np.ndarray
    optimizer_gib: np.ndarray
    activations_gib: np.ndarray
    memory_gib: np.ndarray
    """Sum of the four parts (the system's reserved memory is not included)."""
    oom: np.ndarray
    """True when memory_gib plus the system's reserved memory exceeds the GPU's memory."""
    tokens_per_s: np.ndarray

    def row(self, index: int) -> dict[str, float | bool]:
        """One strategy's values as plain Python numbers."""
        return {f.name: getattr(self, f.name)[index].item() for f in fields(self)}


def predict(
    model: ModelConfig | ModelShape,
    strategies: StrategyArray | Strategy,
    system: System,
    *,
    dtype: str = "bf16",
    calibration: Calibration | None = None,
    flash_attention: bool | None = None,
    backend: str | BackendProfile = "native",
) -> Prediction:
    """Predict every strategy of ``strategies`` (PlanError if one is impossible for the model) as
    ``backend`` (a name of :data:`cona.planner.profiles.BACKENDS`, or a profile) runs them;
    ``flash_attention`` overrides the profile's attention kernel."""
    shape = model_shape(model)
    array = StrategyArray.from_strategies([strategies]) if isinstance(strategies, Strategy) else strategies
    _refuse_invalid(shape, array)
    used_dtype = system.resolve_dtype(dtype)
    if used_dtype not in DTYPE_BYTES:
        raise PlanError(f"dtype {used_dtype} is not modelled; use one of {', '.join(DTYPE_BYTES)}")
    profile = backend if isinstance(backend, BackendProfile) else backend_profile(backend)
    if flash_attention is not None and flash_attention != profile.flash_attention:
        profile = dataclasses.replace(profile, flash_attention=flash_attention)
    return _Step(shape, array, system, used_dtype, profile, calibration).prediction()


def invalid_reasons(model: ModelConfig | ModelShape, strategy: Strategy) -> list[str]:
    """Why the engine cannot train ``strategy`` on ``model`` (empty when it can; :mod:`cona.layout_rules`)."""
    return layout_failures(LayoutSizes.of_shape(model_shape(model)), strategy)


def valid_mask(model: ModelConfig | ModelShape, strategies: StrategyArray) -> np.ndarray:
    """Which strategies the engine can train on ``model`` (vectorised :mod:`cona.layout_rules`;
    :func:`invalid_reasons` says why one cannot)."""
    return layout_mask(LayoutSizes.of_shape(model_shape(model)), strategies)


def _refuse_invalid(shape: ModelShape, strategies: StrategyArray) -> None:
    if len(strategies) == 0:
        raise PlanError("no strategy to predict")
    invalid = np.flatnonzero(~valid_mask(shape, strategies))
    if invalid.size:
        strategy = strategies[int(invalid[0])]
        reasons = "; ".join(invalid_reasons(shape, strategy))
        raise PlanError(f"impossible strategy {strategy.short()}: {reasons}")


class _Step(StepTerms):
    """The terms of one iteration for every strategy (arrays); built once per predict call."""

    def p2p_time(self) -> np.ndarray:
        """Pipeline sends on the critical path: one forward and one backward per micro-batch and chunk."""
        # Megatron scatters the activation over the tp ranks; the native engine's ranks each send their local
        # output: the whole activation, or its sequence shard with sequence parallelism.
        split = self.profile.pp_scatter | self.sp
        message = self.tokens * self.shape.hidden * self.e / np.where(split, self.tp, 1.0)
        bandwidth, latency = group_bandwidth(self.system, self.pp, self.tp * self.dp)
        one = latency + message / bandwidth
        return self.comm_scale * np.where(self.pp > 1, 2.0 * self.m * self.v * one, 0.0)

    def stage_params(self) -> np.ndarray:
        """Parameters on one GPU of the last stage: its blocks, the output matrix (the tied embedding's copy
        or its own), the final norm, BERT's head, and with pp = 1 the embeddings too."""
        shape = self.shape
        h = shape.hidden
        blocks = self.layers * flops.block_weight_params(shape, self.tp)
        head = shape.vocab * h / self.tp + shape.norm_params * h
        if shape.mlm_head:  # dense and norm replicated over tp, the output bias split like the matrix
            head = head + h * h + shape.bias * h + shape.norm_params * h + shape.vocab / self.tp
        first_stage = shape.seq * h if shape.position_embeddings else 0.0
        if not shape.tied_embeddings:
            first_stage = first_stage + shape.vocab * h / self.tp
        return blocks + head + np.where(self.pp > 1, 0.0, first_stage)

    def dp_comm_exposed(self, forward_mb: np.ndarray, backward_mb: np.ndarray) -> np.ndarray:
        """Data-parallel traffic not hidden under compute, as CONA's engine does it.

        ZeRO 0: one all-reduce of the fp32 gradients after the last micro-batch (nothing overlaps it).
        ZeRO 1/2 (FSDP2 keeping parameters gathered from forward to backward, resharding after each backward):
        an all-gather of the 16-bit parameters under every micro-batch's forward, and a reduce-scatter of the
        fp32 gradients under the last micro-batch's backward. ZeRO 3: the all-gather in every backward too. An
        overlapped collective still exposes one block's share (the first gather, the last reduce).
        """
        params = self.stage_params()
        bandwidth, latency = group_bandwidth(self.system, self.dp, self.tp)
        grads = GRAD_REDUCE_BYTES * params
        gather = self.comm_scale * all_gather_time(params * self.e, self.dp, bandwidth, latency)
        # A ring reduce-scatter costs what an all-gather of the same bytes does.
        reduce = self.comm_scale * all_gather_time(grads, self.dp, bandwidth, latency)
        exposed = lambda comm, window: np.maximum(comm / self.layers, comm - window)  # noqa: E731
        zero0 = self.comm_scale * all_reduce_time(grads, self.dp, bandwidth, latency)
        forward_gathers = self.m * exposed(gather, forward_mb)
        zero12 = forward_gathers + exposed(reduce, backward_mb)
        zero3 = zero12 + self.m * exposed(gather, backward_mb)
        return np.select([self.zero == 0, self.zero == 3], [zero0, zero3], zero12)

    def tied_embedding_sync(self) -> np.ndarray:
        """With pp > 1 the first and last stage both hold the tied embedding: they all-reduce its gradient."""
        rows = self.shape.vocab * self.shape.hidden / self.tp / np.where(self.zero >= 1, self.dp, 1.0)
        stride = self.tp * self.dp * np.maximum(self.pp - 1.0, 1.0)
        bandwidth, latency = group_bandwidth(self.system, np.full_like(self.pp, 2.0), stride)
        sync = all_reduce_time(GRAD_REDUCE_BYTES * rows, 2.0, bandwidth, latency)
        return self.comm_scale * np.where((self.pp > 1) & self.shape.tied_embeddings, sync, 0.0)

    def optimizer_time(self) -> np.ndarray:
        """The step's passes over this GPU's share of the parameters (clipping, Adam; the profile's bytes)."""
        sharded = np.where(self.zero >= 1, self.dp, 1.0)
        return self.memory_time(self.stage_params() / sharded * self.profile.step_param_bytes, kernels=8)

    # ---- memory --------------------------------------------------------------------------------------------
    def memory_gib(self) -> dict[str, np.ndarray]:
        """Weights, gradients, Adam state and activations per GPU, on the worse of the first and last stage.

        As CONA's engine keeps them: fp32 parameters, gradients and Adam m, v (4 + 4 + 8 bytes per parameter),
        sharded over dp from ZeRO 1 on (FSDP2 has no optimizer-only sharding: ZeRO 1 and 2 are one mode);
        plus the 16-bit copies the compute uses (mixed precision): autocast's casts saved for backward
        (ZeRO 0), the gathered parameters kept from forward to backward (ZeRO 1/2) or two gathered blocks
        (ZeRO 3), and with several micro-batches the unsharded gradients FSDP2 accumulates until the last.
        """
        params = self.stage_params()
        block_params = flops.block_weight_params(self.shape, self.tp)
        copy = float(self.e)  # bytes of the compute copy: a 16-bit one, or the fp32 unsharded parameter
        sharded = self.zero >= 1
        shards = np.where(sharded, self.dp, 1.0)
        autocast_copy = 0.0 if self.e == 4 else copy
        compute_copy = np.select(
            [self.zero == 0, self.zero == 3],
            [params * autocast_copy, 2.0 * block_params * copy],
            params * copy,
        )
        accumulated = np.where(sharded & (self.m > 1), params * copy, 0.0)
        parts = {
            "weights_gib": 4.0 * params / shards + compute_copy,
            "grads_gib": GRAD_REDUCE_BYTES * params / shards + accumulated,
            "optimizer_gib": 8.0 * params / shards,
            "activations_gib": self.activation_bytes(),
        }
        return {key: value / GIB for key, value in parts.items()}

    def activation_bytes(self) -> np.ndarray:
        shape = self.shape
        stored = self.tokens * flops.block_activation_bytes_per_token(
            shape,
            self.tp,
            self.sp,
            self.e,
            flash_attention=self.flash,
            keep_attention_scores=self.recompute != SELECTIVE_RECOMPUTE,
        )
        checkpoint = self.tokens * shape.hidden * self.e / np.where(self.sp, self.tp, 1.0)
        full = self.recompute == FULL_RECOMPUTE
        # Full recompute keeps each block's input and rebuilds one block's activations at a time.
        per_microbatch = np.where(full, self.layers * checkpoint, self.layers * stored)
        working = np.where(full, stored, 0.0)
        interleave = np.where(self.v > 1, 1.0 + (self.pp - 1.0) / (self.pp * self.v), 1.0)
        in_flight = np.where(self.schedule == GPIPE, self.m, np.minimum(self.m, self.pp) * interleave)
        first_stage = in_flight * per_microbatch + working
        logits = self.tokens * shape.vocab / self.tp * (self.e + 4.0)
        last_stage = per_microbatch + working + logits
        return np.maximum(first_stage, last_stage)

    # ---- the whole step ------------------------------------------------------------------------------------
    def prediction(self) -> Prediction:
        overhead = self.m * self.overhead_per_microbatch
        block = self.block_times()
        block_compute = block["forward"] + block["backward"] + block["recompute"]
        tp_block = self.tp_comm_per_block(block)
        head = self.head_time()
        compute = self.m * (self.layers * block_compute + head)
        tp_comm = self.m * (self.layers * tp_block + self.tp_comm_head())
        stage_time = self.layers * (block_compute + tp_block)
        bubble = np.where(self.schedule == GPIPE, 1.0, 1.0 / self.v) * (self.pp - 1.0) * stage_time
        p2p = self.p2p_time() + self.tied_embedding_sync()
        window_fw = self.layers * block["forward"]
        window_bw = self.layers * (block["backward"] + block["recompute"])
        dp_exposed = np.where(self.dp > 1, self.dp_comm_exposed(window_fw, window_bw), 0.0)
        optimizer = self.optimizer_time()
        device = compute + tp_comm + bubble + p2p + dp_exposed + optimizer
        host = self.host_time()
        host_bound = np.maximum(host - device, 0.0)
        total = device + host_bound + overhead
        memory = self.memory_gib()
        memory_total = sum(memory.values())
        oom = memory_total + self.system.gpu.reserved_gib > self.system.gpu.memory_gib
        return Prediction(
            iteration_time_s=total,
            compute_s=compute,
            tp_comm_s=tp_comm,
            pp_bubble_s=bubble,
            pp_p2p_s=p2p,
            dp_comm_exposed_s=dp_exposed,
            optimizer_s=optimizer,
            overhead_s=np.broadcast_to(overhead, total.shape),
            host_bound_s=host_bound,
            host_dispatch_s=host,
            memory_gib=memory_total,
            oom=oom,
            tokens_per_s=self.gbs_tokens / total,
            **memory,
        )
