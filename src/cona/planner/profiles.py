"""How each training backend runs a step: the part of the performance model that is not the hardware.

The same strategy costs different time on CONA's native engine and on Megatron-DeepSpeed: different
attention kernels, different overlap of the tensor-parallel collectives, different optimizer passes,
different pipeline messages and a different host dispatch. A :class:`BackendProfile` holds those
differences as data; :mod:`cona.planner.step_compute` and :mod:`cona.planner.perf_model` read it.
Every number has its source in docs/perf-model.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from cona.config import TrainingConfig
from cona.errors import PlanError

BACKENDS = ("native", "megatron-deepspeed")


@dataclass(frozen=True, kw_only=True, slots=True)
class HostDispatch:
    """Host seconds spent launching a step's kernels; the step takes ``max(host, device)``.

    ``block_s`` per transformer block of the stage and micro-batch (its forward and backward kernels),
    ``micro_batch_s`` per micro-batch whatever the blocks (embedding, head, loss, the step's Python),
    ``step_block_s`` per block once per step (clipping and the optimizer's per-tensor work).
    """

    block_s: float
    micro_batch_s: float
    step_block_s: float


@dataclass(frozen=True, kw_only=True, slots=True)
class BackendProfile:
    """What one backend does differently with the same strategy (see the module docstring)."""

    name: str
    flash_attention: bool
    """A fused flash kernel (scores stay on chip, its backward recomputes them), else materialised
    s x s scores: batched matmuls that write and read them, softmax and dropout kernels over them."""
    tp_backward_overlap: bool
    """The backward's tensor-parallel collectives of the column-parallel linears (QKV, fc1) run under their
    gradient matmuls (Megatron's asynchronous all-reduce or reduce-scatter under the weight gradient, and the
    sequence-parallel input re-gather under the input gradient); else every collective is exposed."""
    sp_regather: bool
    """Sequence parallelism stores the QKV and fc1 inputs sharded and all-gathers them again in backward."""
    pp_scatter: bool
    """Pipeline messages are split over the tp ranks (Megatron's scatter/gather); else each tp rank sends
    its whole local output (the full activation, or its sequence shard with sequence parallelism)."""
    wgrad_accumulate_bytes: float
    """Bytes per weight element that every weight-gradient matmul adds beyond its 16-bit output: Megatron's
    fused accumulation reads and writes the fp32 main gradient (8); 0 where the cast is a separate pass."""
    micro_batch_param_bytes: float
    """Bytes per parameter and micro-batch outside the matmuls: autocast's cast of the fp32 weights to 16
    bits (read 4, write 2) and of the 16-bit weight gradients to fp32 (read 2, write 4); 0 for fp16
    weights."""
    step_param_bytes: float
    """Bytes per parameter once per step: clipping and the optimizer (and Megatron's unscale, copies,
    zeroing)."""
    host: HostDispatch
    graph_host: HostDispatch | None = None
    """Host dispatch under CUDA graphs (None: the backend does not capture them)."""
    device_time_factor: float = 1.0
    """Accelerator seconds over the model's kernel times (which are compiled kernels' for the native
    engine): :data:`EAGER_DEVICE_FACTOR` for a native run that does not compile. A CPU system ignores it:
    its file is measured eager already."""

    def with_cuda_graphs(self, enabled: bool) -> BackendProfile:
        """This profile with CUDA graphs on or off (off: the plain dispatch)."""
        if enabled:
            return self
        return replace(self, graph_host=None)


NATIVE_HOST = HostDispatch(block_s=1.125e-3, micro_batch_s=12.0e-3, step_block_s=0.36e-3)
"""Compiled without CUDA graphs, from a profile of the host phases of GPT-125M (12 blocks, mbs 8,
gradient-noise inputs on every step): 25.5 ms of forward and backward dispatch per micro-batch and 4.3 ms per
step (clip 1.54, optimizer 2.22, zeroing 0.06, interval sums 0.48). How the 25.5 ms splits into a fixed part
and a part per block is not in the profile: 12 ms fixed is the least that keeps GPT-350M (24 blocks) mbs 8,
measured device-bound at 47.85 ms a step, from being host-bound. Both rows are therefore not independent
checks of the host term (docs/perf-model.md)."""
NATIVE_GRAPH_HOST = HostDispatch(block_s=0.59e-3, micro_batch_s=6.2e-3, step_block_s=0.275e-3)
"""Compiled with CUDA graphs, the same profile: 13.2 ms of forward and backward per micro-batch,
3.3 ms per step (clip 0.62, optimizer 2.19, zeroing 0.06, interval sums 0.43), split in the same ratio."""
EAGER_HOST = HostDispatch(block_s=1.70e-3, micro_batch_s=18.1e-3, step_block_s=NATIVE_HOST.step_block_s)
"""Eager (nothing compiled), measured on an H100's host (GPT-125M, mbs 8,
host-bound): the whole step took 41.6-42.3 ms, of which clipping and the optimizer 3.4-3.8 ms, so 38.5 ms of
forward and backward dispatch per micro-batch, against 22.9 ms compiled without graphs on the same host
(1.66x: eager launches every unfused kernel). Split into a fixed part and a part per block in
:data:`NATIVE_HOST`'s ratio; clipping and the optimizer are the same eager code in both modes (measured
within 0.4 ms). Hosts differ by far more than a prior can know (the same eager step runs device-bound in
17.5 ms on a fast host, and host-bound eager gbs 8-16 steps take 29-61 ms across hosts): this prior is a
typical host, and a run's measured lines correct it (:mod:`cona.planner.step_shape`). A prior at the fast
end of the hosts predicts a run's first trials up to 2x too fast."""
EAGER_DEVICE_FACTOR = 1.38
"""An eager step's device time over a compiled step's, same strategy and GPU: GPT-125M took 50 against 36 ms
at mbs 32 and 93 against 68 ms at mbs 64 (1.39 and 1.37).
Eager runs the memory-bound kernels (norms, GELU, dropout, residual adds, the loss) one by one where
torch.compile fuses them. Taken on the whole device time, matrix and memory alike: the split is not
measured. Without it the prior put an eager gbs 32 at compiled speed, and two host-bound points (gbs 8 and
16) cannot correct a device term that neither shows (gbs 32 predicted 1.29-1.45x too fast)."""
MEGATRON_HOST = NATIVE_HOST
"""Eager PyTorch with fused kernels: taken as the native engine's uncaptured dispatch (not measured; at the
sizes Megatron runs, a block's device time is tens of milliseconds and the host never binds)."""

AUTOCAST_PARAM_BYTES = 12.0
"""Weight cast fp32 -> 16 bits (4 + 2) before the forward and weight-gradient cast 16 bits -> fp32 (2 + 4)."""
NATIVE_STEP_PARAM_BYTES = 40.0
"""clip_grad_norm_ (norm: read 4; scale: read and write 4) and fused AdamW on fp32 state (read p, g, m, v,
write p, m, v: 28)."""
MEGATRON_STEP_PARAM_BYTES = 58.0
"""Megatron's mixed-precision optimizer step on fp32 main gradients: unscale with the inf check (8), the
gradient norm and clipping (12), fused Adam (28), copy of the fp32 main parameters to the 16-bit model (6),
zeroing the main-gradient buffer (4)."""
MEGATRON_WGRAD_ACCUMULATE_BYTES = 8.0


def native_profile(*, cuda_graphs: bool = True) -> BackendProfile:
    """CONA's engine: SDPA flash attention, DTensor TP (collectives exposed), fp32 weights under autocast,
    torch.compile (with CUDA graphs where :func:`cona.engine.step_modes.uses_cuda_graphs` allows)."""
    return BackendProfile(
        name="native",
        flash_attention=True,
        tp_backward_overlap=False,
        sp_regather=False,
        pp_scatter=False,
        wgrad_accumulate_bytes=0.0,
        micro_batch_param_bytes=AUTOCAST_PARAM_BYTES,
        step_param_bytes=NATIVE_STEP_PARAM_BYTES,
        host=NATIVE_HOST,
        graph_host=NATIVE_GRAPH_HOST if cuda_graphs else None,
    )


def megatron_profile() -> BackendProfile:
    """Megatron-LM / Megatron-DeepSpeed GPT as Korthikanti et al. (2022) ran it: 16-bit weights with fp32
    main gradients, materialised attention scores, asynchronous TP collectives in backward, sequence
    parallelism that re-gathers the linear inputs, scatter/gather pipeline messages."""
    return BackendProfile(
        name="megatron-deepspeed",
        flash_attention=False,
        tp_backward_overlap=True,
        sp_regather=True,
        pp_scatter=True,
        wgrad_accumulate_bytes=MEGATRON_WGRAD_ACCUMULATE_BYTES,
        micro_batch_param_bytes=0.0,
        step_param_bytes=MEGATRON_STEP_PARAM_BYTES,
        host=MEGATRON_HOST,
    )


def run_profile(backend: str, training: TrainingConfig) -> BackendProfile:
    """The profile of ``backend`` as a run of ``training`` uses it: CUDA graphs only where that run can
    capture them (compiled on the GPU with ``training.cuda_graphs``; the strategy's own conditions are the
    step model's), and an eager run's accelerator kernels at :data:`EAGER_DEVICE_FACTOR` and its dispatch at
    :data:`EAGER_HOST`. An eager run, or one with graphs off, dispatches every kernel from the host: the
    graph profile puts GPT-125M mbs 8 eager at 2.3x its measured tokens/s, and a fit on that one point
    under-predicts the larger batches by a third."""
    compiled = training.runtime.compiles_on("cuda")
    profile = backend_profile(backend).with_cuda_graphs(training.runtime.cuda_graphs and compiled)
    if backend == "native" and not compiled:
        profile = replace(profile, device_time_factor=EAGER_DEVICE_FACTOR, host=EAGER_HOST)
    return profile


def backend_profile(name: str, *, cuda_graphs: bool = True) -> BackendProfile:
    """The profile of backend ``name`` (``--backend``); PlanError naming the flag for an unknown one."""
    if name == "native":
        return native_profile(cuda_graphs=cuda_graphs)
    if name == "megatron-deepspeed":
        return megatron_profile()
    raise PlanError(f"--backend: unknown backend '{name}'; use one of {', '.join(BACKENDS)}")
