"""This rank's part of a training step's gradient-noise inputs (the method is in :mod:`cona.engine.gns`).

:class:`NoiseInputs` knows which gradients count and with what weight, holds the per-micro-batch norm meter
and the difference estimator's memory, says into how many pieces a measured step's single micro-batch is
cut (:meth:`NoiseInputs.pieces_for`), and turns a step's all-reduced sums into the step's
:class:`~cona.engine.step_output.PendingStepOutput`. Everything stays on the device.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from cona.engine import gns
from cona.engine.step_output import PendingStepOutput
from cona.strategy import Strategy, noise_step_pieces


def local_grads(params: list[nn.Parameter]) -> list[torch.Tensor]:
    """This rank's pieces of the gradients that exist (a DTensor's local shard)."""
    return [gns.local_tensor(p.grad) for p in params if p.grad is not None]


def weighted_sqr(grads: list[torch.Tensor], weights: torch.Tensor) -> torch.Tensor:
    """``sum_i weights[i] * |grads[i]|^2`` as a device scalar."""
    if not grads:
        return torch.zeros((), device=weights.device)
    norms = torch.stack(torch._foreach_norm(grads)).float()
    return (norms.square() * weights).sum()


class NoiseInputs:
    """Squared gradient norms over a step's small batches and its big batch, for one rank.

    The GNS parameters are all but the embedding/head matrices; those are counted apart (the "tied" sum,
    part of the gradient norm, not of the noise inputs) where this rank counts them: under pp > 1 a tied
    matrix on the first stage only, an untied head on the last stage. A tensor is weighted by its shard
    count over ``dp * tp`` so that the all-reduced sums count each element once.
    """

    def __init__(
        self,
        model_parts: list[nn.Module],
        *,
        strategy: Strategy,
        tie_embeddings: bool,
        is_first_stage: bool,
        fsdp: bool,
        device: torch.device,
        copy_previous: bool,
    ) -> None:
        self.strategy, self.device = strategy, device
        self.enabled = True
        self.params: list[nn.Parameter] = []
        self.tied_params: list[nn.Parameter] = []
        for part in model_parts:
            for name, param in part.named_parameters():
                if not gns.is_tied(name):
                    self.params.append(param)
                elif is_first_stage or not tie_embeddings:  # the last stage's copy of a tied one is not
                    self.tied_params.append(param)
        self.weights = _shard_weights(self.params, strategy, device)
        self.tied_weights = _shard_weights(self.tied_params, strategy, device)
        # A single micro-batch per rank is cut into pieces on measured steps (not under pp > 1, whose
        # schedule is built for one micro-batch count and shape). Under CUDA graphs too: the pieces replay
        # the graph (HeldPieceGradients), since pairing consecutive replays measured two parameter points
        # (H200, GPT-125M: noise scales of 482-5,222 where the split steps gave 6-50).
        self.pieces = noise_step_pieces(strategy)
        several = strategy.dp * strategy.micro_batches > 1
        # Hooks stay on where every step has several small batches. Where only the pieces of measured
        # steps give them (dp = 1, so never FSDP), they are put on for those steps only: an unmeasured step
        # then runs no hook at all.
        self._modules = _meter_modules(model_parts, fsdp)
        self._hook_per_step = not several and self.pieces > 1
        self.in_one_step = several or self.pieces > 1
        """Whether one measured step gives an estimate (else the difference estimator pairs two)."""
        self.meter = gns.MicroBatchNormMeter(
            self._modules if several else [],
            ranks_per_copy=strategy.tp,
            device=device,
            via_forward_hooks=fsdp,
        )
        self.previous = gns.PreviousGradient(copies=copy_previous)

    def pieces_for(self, measure: bool) -> int:
        """Equal pieces this step's one micro-batch runs as (1: unsplit): :attr:`pieces` on measured steps.

        Accumulating the pieces' gradients gives the step's gradient (the loss shares follow the piece
        count), and the meter sees each piece's gradient at the same parameters, so the estimate needs no
        second step. Only ``mbs = 1`` on one rank (or pp > 1) leaves a single gradient: the difference
        estimator then pairs two consecutive steps.
        """
        return self.pieces if measure and self.enabled else 1

    def start_step(self, grad_factor: float, *, measure: bool) -> bool:
        """Before the step's backward: whether this step measures (``measure`` unless disabled)."""
        measure = measure and self.enabled
        if measure and self._hook_per_step:
            for module in self._modules:
                self.meter.hook(module)
        self.meter.start_step(grad_factor, active=measure)
        return measure

    def disable(self) -> None:
        """Stop measuring (the fields become NaN), e.g. to time what the inputs cost."""
        self.enabled = False
        self.meter.remove()
        self.previous.forget()

    def local_sums(self, n_small: int, measure: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """After the backward: this rank's ``[gns_sqr, tied_sqr, micro-batch sum, pair_sqr]`` to all-reduce,
        and its GNS gradients (the difference estimator holds them after :meth:`output`)."""
        if self._hook_per_step:
            self.meter.remove()  # the sum (a device tensor) is kept: it is read below
        grads = local_grads(self.params)
        gns_sqr = weighted_sqr(grads, self.weights)
        tied_sqr = weighted_sqr(local_grads(self.tied_params), self.tied_weights)
        differences = n_small == 1 and measure
        if not differences:  # an estimate pairs two consecutive steps: forget an older gradient
            self.previous.forget()
        pair_sqr = self.previous.sum_sqr(grads, self.weights) if differences else gns_sqr * 0
        return [gns_sqr, tied_sqr, self.meter.total, pair_sqr], grads

    def output(
        self,
        loss: torch.Tensor,
        sums: list[torch.Tensor],
        grads: list[torch.Tensor],
        *,
        n_small: int,
        measure: bool,
        may_overflow: bool,
    ) -> PendingStepOutput:
        """The step's output from the all-reduced ``[gns_sqr, tied_sqr, micro-batch sum, pair_sqr]``.
        ``may_overflow`` (fp16): a non-finite gradient drops the difference estimate (a host read)."""
        big_sqr, _, small_sum, pair_sum = sums
        gbs = self.strategy.gbs
        if not measure:
            nan = self._device_scalar(math.nan)
            return PendingStepOutput(
                loss=loss,
                gns_small_sqr=nan,
                gns_big_sqr=nan,
                gns_small_batch=gbs // n_small,
                gns_big_batch=gbs,
            )
        if n_small == 1:
            return self._difference_output(loss, big_sqr, pair_sum, grads, may_overflow=may_overflow)
        return PendingStepOutput(
            loss=loss,
            gns_small_sqr=small_sum / n_small,
            gns_big_sqr=big_sqr,
            gns_small_batch=gbs // n_small,
            gns_big_batch=gbs,
        )

    def _difference_output(
        self,
        loss: torch.Tensor,
        big_sqr: torch.Tensor,
        pair_sqr: torch.Tensor,
        grads: list[torch.Tensor],
        *,
        may_overflow: bool,
    ) -> PendingStepOutput:
        """One gradient per step: the previous and this step's gradients are the two small batches."""
        batch = self.strategy.gbs
        # Only fp16 can overflow without the run being broken; its check waits for the device.
        if may_overflow and not math.isfinite(big_sqr.item()):
            self.previous.forget()  # the memory (added to in place) is dropped
            nan = self._device_scalar(math.nan)
            return PendingStepOutput(
                loss=loss, gns_small_sqr=nan, gns_big_sqr=nan, gns_small_batch=batch, gns_big_batch=2 * batch
            )
        estimate = gns.difference_estimate(self.previous.sqr, big_sqr, pair_sqr, batch)
        small, big, small_batch, big_batch = estimate
        self.previous.hold(grads, big_sqr)
        return PendingStepOutput(
            loss=loss,
            gns_small_sqr=self._device_scalar(small) if isinstance(small, float) else small,
            gns_big_sqr=self._device_scalar(big) if isinstance(big, float) else big,
            gns_small_batch=small_batch,
            gns_big_batch=big_batch,
        )

    def _device_scalar(self, value: float) -> torch.Tensor:
        # torch.full fills on the device; torch.tensor(value, device=...) would copy from the host and wait.
        return torch.full((), value, dtype=torch.float32, device=self.device)


class HeldPieceGradients:
    """The gradients of a measured step's earlier pieces under CUDA graphs, summed in buffers the run keeps.

    Each piece replays the graph in a generation of its own (graph trees begin one at a forward with no
    backward pending), and a replay overwrites the outputs of the one before, the gradients among them. So
    before the next piece its gradients move here (:meth:`hold`), and after the last piece they are added to
    its gradients, which then sit in the graph's memory as an unsplit step's do (:meth:`add_to`).
    """

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] | None = None
        self._pieces = 0

    def hold(self, params: list[nn.Parameter]) -> None:
        """Add the parameters' gradients to the held sum and drop them from the parameters."""
        grads = [param.grad for param in params]
        if self._buffers is None or len(self._buffers) != len(grads):
            self._buffers = [torch.empty_like(grad) for grad in grads]
        if self._pieces:
            torch._foreach_add_(self._buffers, grads)
        else:
            torch._foreach_copy_(self._buffers, grads)
        self._pieces += 1
        for param in params:
            param.grad = None

    def add_to(self, params: list[nn.Parameter]) -> None:
        """Add the held sum to the last piece's gradients: the step's gradient; the sum starts afresh."""
        if not self._pieces:
            raise RuntimeError("add_to without a held piece")
        torch._foreach_add_([param.grad for param in params], self._buffers)
        self._pieces = 0


def split_rows(
    batch: tuple[torch.Tensor, torch.Tensor], pieces: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``batch`` cut into ``pieces`` equal row blocks, in order (the step's samples are unchanged)."""
    inputs, targets = batch
    if inputs.shape[0] % pieces:
        raise ValueError(f"a micro-batch of {inputs.shape[0]} rows does not split into {pieces} equal pieces")
    rows = inputs.shape[0] // pieces
    return list(zip(inputs.split(rows), targets.split(rows), strict=True))


def _shard_weights(params: list[nn.Parameter], strategy: Strategy, device: torch.device) -> torch.Tensor:
    dp_tp = strategy.dp * strategy.tp
    return torch.tensor([gns.shard_count(p) / dp_tp for p in params], device=device)


def _meter_modules(model_parts: list[nn.Module], fsdp: bool) -> list[nn.Module]:
    """Where the meter hooks: the parameters themselves, or under FSDP2 each FSDP unit (see gns)."""
    if not fsdp:
        return model_parts
    return [m for part in model_parts for m in (*part.layers.values(), part)]
