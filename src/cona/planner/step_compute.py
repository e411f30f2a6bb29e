"""Device time of one micro-batch on one GPU, per transformer block and for the head (pure numpy).

Every kernel costs its arithmetic at the rate it reaches plus its memory traffic at the bandwidth it
reaches (the additive, "no overlap" form of Calculon, Isaev et al. SC'23: a kernel's tail, epilogue and
operand loads are not hidden under its math). Matmuls use the system's matrix efficiency curve, memory
traffic its memory efficiency curve. What differs between backends (attention kernel, TP overlap, casts)
comes from the :class:`~cona.planner.profiles.BackendProfile`. Formulas and sources: docs/perf-model.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from cona.planner import flops
from cona.planner.flops import Gemm, ModelShape
from cona.planner.profiles import BackendProfile
from cona.planner.systems import System, all_gather_time, all_reduce_time, group_bandwidth
from cona.strategy import RECOMPUTE_CODES, StrategyArray

if TYPE_CHECKING:
    from cona.planner.calibration_factors import Calibration

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
FLASH_BACKWARD_FACTOR = 2.5
"""A flash-attention backward recomputes the scores: 5 matmuls against the forward's 2."""
BLOCK_KERNELS = 6
"""Fused elementwise kernels of one block's forward (2 norms, 2 bias-dropout-adds, activation, softmax):
the memory efficiency is looked up at the traffic of one of them."""
LOSS_BYTES_PER_LOGIT_EXTRA = 16
"""The loss casts logits to fp32 and back: write fp32, read it (softmax), write and read its gradient."""
FULL_RECOMPUTE, SELECTIVE_RECOMPUTE = RECOMPUTE_CODES["full"], RECOMPUTE_CODES["selective"]


class StepTerms:
    """The strategies as float arrays, the kernel rates, and one micro-batch's device time on one GPU."""

    def __init__(
        self,
        shape: ModelShape,
        s: StrategyArray,
        system: System,
        dtype: str,
        profile: BackendProfile,
        calibration: Calibration | None,
    ) -> None:
        self.shape, self.system, self.profile = shape, system, profile
        self.flash = profile.flash_attention
        self.e = DTYPE_BYTES[dtype]
        self.matrix_peak = system.gpu.matrix_tflops[dtype] * 1e12
        self.vector_peak = system.gpu.vector_tflops[dtype] * 1e12
        corrected = calibration is not None
        slower = profile.device_time_factor if system.asynchronous_dispatch else 1.0  # a CPU: measured eager
        self.matrix_scale = slower / calibration.matrix_efficiency if corrected else slower
        self.memory_scale = slower / calibration.memory_efficiency if corrected else slower
        self.comm_scale = 1.0 / calibration.comm_efficiency if corrected else 1.0
        self.host_scale = 1.0 / calibration.host_efficiency if corrected else 1.0
        self.overhead_per_microbatch = calibration.overhead_s if corrected else 0.0
        f = lambda a: np.asarray(a, dtype=float)  # noqa: E731
        self.dp, self.tp, self.pp, self.mbs = f(s.dp), f(s.tp), f(s.pp), f(s.mbs)
        self.m = f(s.gbs) / (self.mbs * self.dp)
        self.v = f(s.virtual_stages)
        # With dp = 1 the engine applies no data-parallel wrapper: every ZeRO stage is plain replication.
        self.zero = np.where(s.dp > 1, s.zero_stage, 0)
        self.recompute, self.schedule = s.recompute, s.pipeline_schedule
        self.sp = np.asarray(s.sequence_parallel, dtype=bool) & (self.tp > 1)
        self.tokens = self.mbs * shape.seq
        self.layers = np.ceil(shape.layers / self.pp)
        self.gbs_tokens = f(s.gbs) * shape.seq

    # ---- kernels -------------------------------------------------------------------------------------------
    def matmul_time(self, flops_per_token: np.ndarray, nbytes: np.ndarray | float = 0.0) -> np.ndarray:
        """A matmul of ``flops_per_token`` x tokens FLOPs moving ``nbytes``: math plus memory traffic."""
        total = flops_per_token * self.tokens
        efficiency = self.system.gpu.matrix_efficiency(total / 1e9)
        math = total / (self.matrix_peak * efficiency)
        return self.matrix_scale * math + self.memory_time(np.asarray(nbytes, dtype=float))

    def memory_time(self, nbytes: np.ndarray, flops: np.ndarray | float = 0, kernels: int = 1) -> np.ndarray:
        """Memory-bound kernels: bytes at the bandwidth, or their arithmetic at the vector rate if slower."""
        gpu = self.system.gpu
        efficiency = gpu.memory_efficiency(np.maximum(nbytes, 1.0) / kernels / 1e6)
        seconds = np.maximum(nbytes / (gpu.memory_gbps * 1e9), flops / self.vector_peak)
        return self.memory_scale * seconds / efficiency

    def gemm_times(self, gemm: Gemm) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Forward, input-gradient and weight-gradient seconds of one weight matmul (each ``2 M k n``)."""
        k, n, e, tokens = np.asarray(gemm.k, float), np.asarray(gemm.n, float), self.e, self.tokens
        activations = e * tokens * (k + n)
        weight = e * k * n
        accumulate = self.profile.wgrad_accumulate_bytes * k * n
        flops_per_token = gemm.flops_per_token()
        forward = self.matmul_time(flops_per_token, activations + weight)
        data_grad = self.matmul_time(flops_per_token, activations + weight)
        weight_grad = self.matmul_time(flops_per_token, activations + weight + accumulate)
        return forward, data_grad, weight_grad

    # ---- one block -----------------------------------------------------------------------------------------
    def block_times(self) -> dict[str, np.ndarray]:
        """Seconds of one block for one micro-batch (no communication): ``forward``, ``backward``,
        ``recompute``, and the gradient matmuls of the column-parallel linears (QKV, fc1) under which a
        backend may hide its backward collectives (``qkv_dgrad``, ``qkv_wgrad``, ``fc1_dgrad``,
        ``fc1_wgrad``)."""
        shape, tokens = self.shape, self.tokens
        times = {g.name: self.gemm_times(g) for g in flops.block_gemms(shape, self.tp)}
        gemm_fw = sum(t[0] for t in times.values())
        gemm_bw = sum(t[1] + t[2] for t in times.values())
        attention_fw, attention_bw = self.attention_times()
        work = flops.block_elementwise_work(shape, self.tp, self.sp, self.e, flash_attention=self.flash)
        elementwise_fw = self.memory_time(tokens * work.main_bytes, tokens * work.main_flops, BLOCK_KERNELS)
        scores_fw = self.memory_time(tokens * work.score_bytes, tokens * work.score_flops, kernels=2)
        casts = self.param_pass_time(flops.block_weight_params(shape, self.tp))
        forward = gemm_fw + attention_fw + elementwise_fw + scores_fw
        backward = gemm_bw + attention_bw + 2.0 * (elementwise_fw + scores_fw) + casts
        # Selective recompute runs the attention core's forward again (a flash kernel's too: the engine
        # checkpoints the core, so its forward reruns before the flash backward).
        selective = attention_fw + scores_fw
        recompute = np.select(
            [self.recompute == FULL_RECOMPUTE, self.recompute == SELECTIVE_RECOMPUTE],
            [forward, np.broadcast_to(selective, forward.shape)],
            0.0,
        )
        overlap = {
            f"{name}_{part}": times[name][index]
            for name in ("qkv", "fc1")
            for index, part in ((1, "dgrad"), (2, "wgrad"))
        }
        return {"forward": forward, "backward": backward, "recompute": recompute, **overlap}

    def attention_times(self) -> tuple[np.ndarray, np.ndarray]:
        """Forward and backward seconds of the score and value products of one block.

        Flash: the causal half, backward 2.5x the forward, no score traffic. Materialised: full size; QK^T
        writes the ``heads/tp x seq`` scores per token and PV reads them back (16-bit), and the backward
        reads and writes them twice over.
        """
        attention_flops = flops.attention_flops_per_token(self.shape, self.tp, causal_skip=self.flash)
        if self.flash:
            return self.matmul_time(attention_flops), self.matmul_time(
                FLASH_BACKWARD_FACTOR * attention_flops
            )
        shape, e = self.shape, self.e
        scores = self.tokens * shape.heads / self.tp * shape.seq * e
        operands = self.tokens * shape.hidden / self.tp * e * 4.0  # q, k in QK^T; v and the output in PV
        forward = self.matmul_time(attention_flops, 2.0 * scores + operands)
        backward = self.matmul_time(2.0 * attention_flops, 4.0 * scores + 2.0 * operands)
        return forward, backward

    def param_pass_time(self, params: np.ndarray) -> np.ndarray:
        """Per-micro-batch passes over a set of parameters outside the matmuls (autocast's casts)."""
        per_param = self.profile.micro_batch_param_bytes if self.e < 4 else 0.0
        return self.memory_time(per_param * params, kernels=2) if per_param else np.zeros_like(self.tp)

    def head_time(self) -> np.ndarray:
        """Embedding, final norm, LM head and loss for one micro-batch (forward and backward)."""
        shape = self.shape
        head_flops = flops.lm_head_flops_per_token(shape, self.tp)
        head = flops.Gemm(name="head", k=shape.hidden, n=shape.vocab / self.tp)
        matmul = sum(self.gemm_times(head)) if not shape.mlm_head else 3.0 * self.matmul_time(head_flops)
        logits_bytes = shape.vocab / self.tp * (4 * self.e + LOSS_BYTES_PER_LOGIT_EXTRA) * self.tokens
        embedding_bytes = 6.0 * shape.hidden * self.e * self.tokens  # lookup, final norm, their backward
        casts = self.param_pass_time(shape.vocab * shape.hidden / self.tp)
        return (
            matmul
            + self.memory_time(logits_bytes, kernels=4)
            + self.memory_time(embedding_bytes, kernels=4)
            + casts
        )

    def host_time(self) -> np.ndarray:
        """Host seconds to dispatch one step on a rank: its stage's blocks for every micro-batch, and once
        for the step. CUDA graphs (where the profile has them) apply as in
        :func:`cona.engine.step_modes.uses_cuda_graphs`: the whole model compiled, one micro-batch a step."""
        if not self.system.asynchronous_dispatch:
            return np.zeros_like(self.tp)
        plain, graphs = self.profile.host, self.profile.graph_host
        if graphs is not None:
            whole = (self.tp == 1) & (self.pp == 1) & ((self.dp == 1) | (self.zero == 0)) & (self.m == 1)
        else:
            whole = np.zeros_like(self.tp, dtype=bool)
        pick = lambda key: np.where(whole, getattr(graphs or plain, key), getattr(plain, key))  # noqa: E731
        micro_batch = self.layers * pick("block_s") + pick("micro_batch_s")
        # The host has its own calibrated factor: the device's factors say nothing about the Python and
        # launch work, and a host-bound measurement must be able to move the host alone.
        return self.host_scale * (self.m * micro_batch + self.layers * pick("step_block_s"))

    # ---- tensor parallel -----------------------------------------------------------------------------------
    def tp_collective_times(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One all-reduce, one all-gather (= one reduce-scatter) of a micro-batch's activation over tp."""
        activation = self.tokens * self.shape.hidden * self.e
        bandwidth, latency = group_bandwidth(self.system, self.tp, np.ones_like(self.tp))
        reduce = self.comm_scale * all_reduce_time(activation, self.tp, bandwidth, latency)
        gather = self.comm_scale * all_gather_time(activation, self.tp, bandwidth, latency)
        return reduce, gather, activation

    def tp_comm_per_block(self, block: dict[str, np.ndarray]) -> np.ndarray:
        """Exposed TP collectives of one block and micro-batch.

        Forward: 2 all-reduces, or 2 (all-gather + reduce-scatter) with sequence parallelism (a ring
        reduce-scatter plus all-gather costs one all-reduce); full recompute repeats them. Backward: the
        same again, exposed on the native engine; Megatron runs the column-parallel linears' collective
        (all-reduce, or reduce-scatter) under their weight-gradient matmul and the sequence-parallel
        re-gather of their input under the input-gradient matmul, so only the excess is exposed, while the
        all-gathers before the row-parallel backward stay exposed.
        """
        reduce, gather, _ = self.tp_collective_times()
        pair = np.where(self.sp, 2.0 * gather, reduce)  # one all-reduce, or one all-gather + reduce-scatter
        full = self.recompute == FULL_RECOMPUTE
        forward = (2.0 + 2.0 * full) * pair
        if not self.profile.tp_backward_overlap:
            return forward + 2.0 * pair
        hidden = lambda comm, window: np.maximum(comm - window, 0.0)  # noqa: E731
        column = np.where(self.sp, gather, reduce)
        exposed = sum(hidden(column, block[f"{name}_wgrad"]) for name in ("qkv", "fc1"))
        regather = self.profile.sp_regather & self.sp & ~full
        regathered = sum(hidden(gather, block[f"{name}_dgrad"]) for name in ("qkv", "fc1"))
        row_parallel = np.where(self.sp, 2.0 * gather, 0.0)
        return forward + row_parallel + exposed + np.where(regather, regathered, 0.0)

    def tp_comm_head(self) -> np.ndarray:
        """The embedding's forward all-reduce and the LM head input's backward all-reduce."""
        reduce, _, _ = self.tp_collective_times()
        return 2.0 * reduce
