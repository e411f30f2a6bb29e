"""Apply tensor parallelism, activation recompute, compile and data parallelism to a GPT (or one stage).

Recipe order (torchtitan's): TP -> recompute -> compile -> data parallel. Every step keeps parameter FQNs.

``zero_stage`` -> data parallel over ``mesh["dp"]``:

* 0: parameters, gradients and optimizer state replicated; gradients are averaged with flattened
  all-reduces after the last micro-batch (:class:`GradAllReducer`). FSDP2 has no NO_SHARD mode and classic
  DDP does not combine with TP/PP.
* 1 and 2: FSDP2 ``fully_shard(reshard_after_forward=False)``: gradients and optimizer state sharded,
  parameters kept gathered between forward and backward (ZeRO-2; ZeRO-1 alone does not exist in FSDP2).
* 3: FSDP2 ``fully_shard(reshard_after_forward=True)``: parameters sharded too.

With dp = 1 no data-parallel wrapper is applied at all.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.checkpoint import checkpoint

from cona.engine.model import GPT
from cona.strategy import Strategy

ALL_REDUCE_BUCKET_ELEMENTS = 32 * 1024 * 1024


def _block_plan(block: nn.Module, seq_layout: Placement, *, sequence_parallel: bool) -> dict[str, Any]:
    """One block's TP plan: column-parallel inputs of attention and MLP, row-parallel outputs; with sequence
    parallelism the norms run on the rank's sequence chunk and attention / MLP gather it first."""
    plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=seq_layout),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=seq_layout),
    }
    if block.feed_forward.w3 is not None:
        plan["feed_forward.w3"] = ColwiseParallel()
    if sequence_parallel:
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan |= {
            "attention_norm": SequenceParallel(),
            "attention": gather,
            "ffn_norm": SequenceParallel(),
            "feed_forward": gather,
        }
    return plan


def apply_tp(model: GPT, tp_mesh: DeviceMesh, *, sequence_parallel: bool) -> None:
    """Megatron-style TP: column-parallel wq/wk/wv/w1/w3, row-parallel wo/w2, vocab-parallel embedding and
    head.

    wk/wv are split by whole key/value heads (``kv_heads % tp == 0``, see ``validate_layout``), so each rank
    pairs its ``heads/tp`` query heads with their own ``kv_heads/tp`` key/value heads. The head's logits stay
    a DTensor sharded over the vocabulary, for ``loss_parallel``. With sequence parallelism the residual
    stream between blocks is the rank's sequence chunk (a plain local tensor). BERT's masked-LM transform
    (dense, GELU, norm) stays replicated, as in Megatron.
    """
    seq_layout = Shard(1) if sequence_parallel else Replicate()
    if model.tok_embeddings is not None:
        parallelize_module(
            model.tok_embeddings,
            tp_mesh,
            RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        )
    for key, block in model.layers.items():
        parallelize_module(
            block, tp_mesh, _block_plan(block, seq_layout, sequence_parallel=sequence_parallel)
        )
        if sequence_parallel and key == "0":
            # Embeddings + positions are replicated; block 0 keeps only this rank's chunk (no communication).
            parallelize_module(
                block,
                tp_mesh,
                PrepareModuleInput(
                    input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
                ),
            )
    if model.output is not None:
        head_input = seq_layout
        if sequence_parallel:
            parallelize_module(model.norm, tp_mesh, SequenceParallel())
        if model.mlm_head is not None and sequence_parallel:
            # The replicated transform needs the whole sequence: gather it before, not after.
            gather_local = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
            )
            parallelize_module(model.mlm_head, tp_mesh, gather_local)
            head_input = Replicate()
        parallelize_module(
            model.output,
            tp_mesh,
            ColwiseParallel(input_layouts=head_input, output_layouts=Shard(-1), use_local_output=False),
        )
        model.tie_output()  # the plan gave the head its own DTensor; share the embedding's again


def _recompute_forward(module: torch.nn.Module) -> None:
    """Make ``module`` recompute its forward in backward.

    The forward is replaced on the instance rather than wrapping the module (``checkpoint_wrapper``),
    because a wrapper inserts ``_checkpoint_wrapped_module`` into every parameter name.
    """
    forward = module.forward

    def recomputed(*args: torch.Tensor) -> torch.Tensor:
        return checkpoint(forward, *args, use_reentrant=False)

    module.forward = recomputed


def apply_ac(model: GPT, mode: str) -> None:
    """Activation recompute: ``selective`` = the attention core, ``full`` = each whole block."""
    if mode == "none":
        return
    for block in model.layers.values():
        _recompute_forward(block if mode == "full" else block.attention.core)


def apply_compile(model: GPT, *, recompute: str, tensor_parallel: bool) -> None:
    """torch.compile each block in place (``Module.compile`` keeps FQNs; identical blocks share a graph),
    with static shapes as the whole-model compile (:mod:`cona.engine.step_modes`).

    NOTE: with torch 2.13, AOTAutograd fails on a recomputed region inside a compiled one when it holds TP
    (DTensor) parameters ("expected all tensors_saved_with_vc_check to be Tensors"). For TP with recompute
    the recompute boundary therefore stays eager and only what runs inside it is compiled: the MLP, and
    the attention too when whole blocks are recomputed (selective recompute sits inside the attention).
    """
    for block in model.layers.values():
        if not tensor_parallel or recompute == "none":
            block.compile(dynamic=False)
            continue
        block.feed_forward.compile(dynamic=False)
        if recompute == "full":
            block.attention.compile(dynamic=False)


def apply_fsdp(model: GPT, dp_mesh: DeviceMesh, *, zero_stage: int, param_dtype: torch.dtype | None) -> None:
    """FSDP2 per block, then the root (embeddings, final norm and the tied head share the root group)."""
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    reshard = zero_stage == 3
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy)


class GradAllReducer:
    """ZeRO-0 data parallelism: average the (local shards of the) gradients over the dp group.

    Flattened into buckets of at most :data:`ALL_REDUCE_BUCKET_ELEMENTS` per dtype, so a step costs a
    few large collectives rather than one per parameter.
    """

    def __init__(self, params: list[torch.nn.Parameter], dp_mesh: DeviceMesh) -> None:
        self.params = params
        self.group = dp_mesh.get_group()

    @torch.no_grad()
    def all_reduce(self) -> None:
        grads = [
            p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            for p in self.params
            if p.grad is not None
        ]
        for bucket in _buckets(grads):
            torch._foreach_copy_(bucket, _all_reduce_flat(bucket, self.group, dist.ReduceOp.AVG))


def _all_reduce_flat(
    tensors: list[torch.Tensor], group: dist.ProcessGroup, op: dist.ReduceOp = dist.ReduceOp.SUM
) -> list[torch.Tensor]:
    """All-reduce ``tensors`` as one flat buffer; returns views of the result shaped like the inputs."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, op=op, group=group)
    return [
        chunk.view_as(t) for chunk, t in zip(flat.split([t.numel() for t in tensors]), tensors, strict=True)
    ]


def match_grad_placements(params: list[torch.nn.Parameter]) -> None:
    """Give every DTensor gradient its parameter's placements.

    Autograd does not always: under sequence parallelism the norm weights are replicated over tp but each
    rank saw only its sequence chunk, so their gradients are ``Partial`` sums (Megatron all-reduces these
    "sequence parallel" grads too); the vocab-parallel embedding's gradient comes back ``Replicate``. The
    partial sums are reduced with one flattened all-reduce per (mesh, placements, dtype); the rest are
    local re-slicings.
    """
    partial: dict[tuple, list[torch.nn.Parameter]] = {}
    for param in params:
        grad = param.grad
        if not isinstance(grad, DTensor) or tuple(grad.placements) == tuple(param.placements):
            continue
        if any(placement.is_partial() for placement in grad.placements):
            partial.setdefault((id(grad.device_mesh), tuple(grad.placements), grad.dtype), []).append(param)
        else:
            param.grad = grad.redistribute(param.device_mesh, param.placements)
    for members in partial.values():
        _all_reduce_partial(members)


def _all_reduce_partial(members: list[torch.nn.Parameter]) -> None:
    """Sum the partial gradients of ``members`` (same mesh and placements) and give them their params'."""
    first = members[0].grad
    reduced = [p.grad.to_local() for p in members]
    for mesh_dim, placement in enumerate(first.placements):
        if placement.is_partial():
            reduced = _all_reduce_flat(reduced, first.device_mesh.get_group(mesh_dim))
    summed = [Replicate() if pl.is_partial() else pl for pl in first.placements]
    for param, local in zip(members, reduced, strict=True):
        grad = DTensor.from_local(local, first.device_mesh, summed, run_check=False)
        if tuple(summed) != tuple(param.placements):
            grad = grad.redistribute(param.device_mesh, param.placements)
        param.grad = grad


def _buckets(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    buckets: list[list[torch.Tensor]] = []
    current: list[torch.Tensor] = []
    size = 0
    for tensor in tensors:
        if current and (
            size + tensor.numel() > ALL_REDUCE_BUCKET_ELEMENTS or tensor.dtype != current[0].dtype
        ):
            buckets.append(current)
            current, size = [], 0
        current.append(tensor)
        size += tensor.numel()
    if current:
        buckets.append(current)
    return buckets


def parallelize_gpt(
    model: GPT, mesh: DeviceMesh, strategy: Strategy, *, compile_blocks: bool, param_dtype: torch.dtype | None
) -> None:
    """Apply the strategy's TP, recompute, compile and (for zero >= 1) FSDP2 to ``model`` in place."""
    if strategy.tp > 1:
        apply_tp(model, mesh["tp"], sequence_parallel=strategy.sequence_parallel)
    apply_ac(model, strategy.recompute)
    if compile_blocks:
        apply_compile(model, recompute=strategy.recompute, tensor_parallel=strategy.tp > 1)
    if strategy.dp > 1 and strategy.zero_stage >= 1:
        apply_fsdp(model, mesh["dp"], zero_stage=strategy.zero_stage, param_dtype=param_dtype)
