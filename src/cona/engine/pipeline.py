"""Pipeline parallelism: split GPT into stages that keep global parameter names, and build the schedule.

Stage ``s`` of ``pp * virtual_stages`` lives on pipeline rank ``s % pp`` (the interleaved layout; with one
virtual stage this is just stage = rank). The first stage owns the token and position embeddings, the last
owns the final norm, the masked-LM head (BERT) and the output projection; rotary tables are on every stage
(they are not parameters). When the head is tied to the token embedding, the last stage keeps its own copy
of ``tok_embeddings.weight`` (same name, same initial value) and :class:`TiedEmbeddingSync` sums the two
stages' gradients after backward (Megatron's embedding group), which keeps both copies identical; an untied
head needs none of this.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.pipelining.schedules import _PipelineSchedule
from torch.distributed.tensor import DTensor

from cona.engine.model import GPT
from cona.engine.objective import summed_token_cross_entropy
from cona.strategy import Strategy


def stage_layer_ids(num_layers: int, num_stages: int) -> list[list[int]]:
    """Consecutive block ids per stage, as even as possible.

    The first stage also runs the embedding and the last the LM head, so the blocks left over by an
    uneven division go to the middle stages first (then the first, then the last).
    """
    base, extra = divmod(num_layers, num_stages)
    preference = [*range(1, num_stages - 1), 0, num_stages - 1] if num_stages > 1 else [0]
    counts = [base] * num_stages
    for stage in preference[:extra]:
        counts[stage] += 1
    ids, start = [], 0
    for count in counts:
        ids.append(list(range(start, start + count)))
        start += count
    return ids


def num_stages(strategy: Strategy) -> int:
    """Pipeline stages of the whole model (1 without a pipeline, whatever ``virtual_stages`` says)."""
    return strategy.pp * strategy.virtual_stages if strategy.pp > 1 else 1


def stage_ids_of_rank(strategy: Strategy, pp_rank: int) -> list[int]:
    """The stage indices pipeline rank ``pp_rank`` runs (``virtual_stages`` of them, interleaved)."""
    if strategy.pp == 1:
        return [0]
    return [pp_rank + chunk * strategy.pp for chunk in range(strategy.virtual_stages)]


def split_stage(model: GPT, stage: int, num_stages: int) -> GPT:
    """Prune ``model`` (on meta, in place) down to stage ``stage``; parameter FQNs stay global."""
    keep = {str(i) for i in stage_layer_ids(len(model.layers), num_stages)[stage]}
    for key in [k for k in model.layers if k not in keep]:
        del model.layers[key]
    first, last = stage == 0, stage == num_stages - 1
    if not first:
        model.embeds_inputs = False
        model.pos_embeddings = None
        if not (last and model.config.tie_embeddings):  # the last stage keeps it only as the tied head
            model.tok_embeddings = None
    if not last:
        model.norm = None
        model.mlm_head = None
        model.output = None
    return model


class TiedEmbeddingSync:
    """Sums the tied embedding's gradient between the first and the last pipeline stage.

    Each (dp, tp) coordinate gets its own two-rank group (first stage, last stage). Both stages hold the
    same (dp, tp) piece of the matrix once gradients have their parameter's placements (FSDP2 shard, TP
    vocabulary slice), so summing the local tensors is exact.
    """

    def __init__(self, mesh: DeviceMesh, model_parts: list[GPT]) -> None:
        self.weight: nn.Parameter | None = None
        self.group = None
        for part in model_parts:
            if part.tok_embeddings is not None and part.config.tie_embeddings:
                self.weight = part.tok_embeddings.weight
        if self.weight is None:  # a middle stage, or an untied head: nothing to share
            return
        ranks = mesh.mesh  # [pp, dp, tp] global ranks
        dp, tp = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
        pair = [int(ranks[0, dp, tp]), int(ranks[-1, dp, tp])]
        # Only the two members create their group, so middle stages need not take part.
        self.group = dist.new_group(pair, use_local_synchronization=True)

    def all_reduce_grad(self) -> None:
        if self.weight is None or self.weight.grad is None:
            return
        grad = self.weight.grad
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        dist.all_reduce(local, group=self.group)


class PipelineRunner:
    """This rank's stages and the schedule; runs whole steps of ``strategy.micro_batches`` micro-batches.

    The first stage feeds the token ids, the last the targets and gets the per-micro-batch losses ``L_k``
    (summed token loss times ``share``, :mod:`cona.engine.objective`); a middle stage only relays.
    ``scale_grads`` makes the gradient that of the mean over the micro-batches.
    """

    def __init__(
        self,
        model_parts: list[GPT],
        stage_ids: list[int],
        strategy: Strategy,
        mesh: DeviceMesh,
        device: torch.device,
    ) -> None:
        total = num_stages(strategy)
        self.is_first_stage = 0 in stage_ids
        self.is_last_stage = total - 1 in stage_ids
        self.micro_batches = strategy.micro_batches
        self.loss_factor = 1.0
        self.share: torch.Tensor | float = 1.0
        group = mesh["pp"].get_group()
        stages = [
            PipelineStage(part, stage_id, total, device, group=group)
            for part, stage_id in zip(model_parts, stage_ids, strict=True)
        ]
        self.schedule = build_schedule(stages, strategy, self._loss)

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return summed_token_cross_entropy(logits, targets) * self.share * self.loss_factor

    def run(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        *,
        share: torch.Tensor | float,
        loss_factor: float,
        train: bool,
    ) -> list[torch.Tensor]:
        """One schedule step over the concatenated micro-batches; the last stage returns their losses
        (multiplied by ``loss_factor`` for backward, e.g. an fp16 loss scale, and divided back here)."""
        self.share, self.loss_factor = share, loss_factor
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.is_first_stage else ()
        kwargs = {"target": targets, "losses": losses} if self.is_last_stage else {}
        if train:
            self.schedule.step(*args, return_outputs=False, **kwargs)
        else:
            self.schedule.eval(*args, **kwargs)
        return [loss.detach() / loss_factor for loss in losses]

    def eval_losses(
        self,
        batches: list[tuple[torch.Tensor, torch.Tensor]],
        params: list[nn.Parameter],
        *,
        share: torch.Tensor | float,
    ) -> list[torch.Tensor]:
        """Forward-only losses of any number of micro-batches (the last group is padded with repeats).

        NOTE: pipelining's eval still runs the end-of-step gradient scaling (interleaved schedules), so
        the gradients of ``params`` are set aside meanwhile.
        """
        saved = [(param, param.grad) for param in params]
        for param, _ in saved:
            param.grad = None
        losses: list[torch.Tensor] = []
        try:
            for start in range(0, len(batches), self.micro_batches):
                chunk = batches[start : start + self.micro_batches]
                padded = chunk + [chunk[0]] * (self.micro_batches - len(chunk))
                inputs, targets = (torch.cat(parts) for parts in zip(*padded, strict=True))
                losses += self.run(inputs, targets, share=share, loss_factor=1.0, train=False)[: len(chunk)]
        finally:
            for param, grad in saved:
                param.grad = grad
        return losses


def build_schedule(
    stages: list[PipelineStage],
    strategy: Strategy,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> _PipelineSchedule:
    """The schedule of ``strategy.pipeline_schedule``; ``scale_grads`` turns per-micro-batch mean losses into
    the gradient of the mean over all micro-batches."""
    n_micro = strategy.micro_batches
    if strategy.pipeline_schedule == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(stages, n_microbatches=n_micro, loss_fn=loss_fn, scale_grads=True)
    (stage,) = stages
    schedule_cls = ScheduleGPipe if strategy.pipeline_schedule == "gpipe" else Schedule1F1B
    return schedule_cls(stage, n_microbatches=n_micro, loss_fn=loss_fn, scale_grads=True)
