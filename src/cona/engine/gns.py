"""Inputs of the gradient noise scale: squared gradient norms over a small and over the big (global) batch.

Method (the same for every layout): the small batch is one micro-batch of one dp rank. A tensor hook on
every leaf that autograd accumulates into sees each micro-batch's gradient before accumulation and before
any data-parallel reduction, and adds its squared norm to one device scalar (no host sync). The leaves
are the module parameters, except under FSDP2, where autograd accumulates into FSDP's unsharded
parameters: those are the ones installed on the modules while a block runs, so a forward pre-hook on each
FSDP unit (run after FSDP's own, which installs them) registers the tensor hooks the first time it sees
them. This needs no extra communication and no copy of the gradient; the alternatives were rejected:
the dp-local accumulated gradient is not visible under FSDP2 (reduce-scatter consumes it), and diffs of
accumulated gradients cost a parameter-sized copy per micro-batch. Masked objectives (BERT): a small batch's
gradient is that of its share of the global masked-token mean, see :mod:`cona.engine.objective`.

Where a rank has one micro-batch per step (``micro_batches = 1``, pp = 1), a measured step runs that
micro-batch as equal pieces with gradient accumulation (two halves for an even mbs; see
:meth:`cona.engine.step_noise.NoiseInputs.pieces_for`): the step's samples, loss and gradient are those of the
unsplit step, and the meter gets ``dp * pieces`` small-batch gradients at the same parameters. The pieces run
in the whole-model compile's graph (its batch is dynamic; under CUDA graphs each piece replays one and the
earlier pieces' gradients are held apart, see ``HeldPieceGradients``), eager where that would compile again
(pieces of one row, block-wise compiles). With one sample on one rank (mbs = 1, dp = 1) or under pp > 1 (a
schedule fixed to one micro-batch shape) there is still one gradient per step; then AdaptDL's difference
estimator is used: the previous step's gradient is kept (by reference, no copy; copied under CUDA graphs) and
the two consecutive gradients play the two small batches. It is biased: the parameters moved in between, by a
lot during LR warm-up (a first pair's estimate can be 100x the later ones'), which the tracker's robust
averages must absorb.

Measuring is optional per step (the trainer measures the few steps before each metrics line, and those
before the run's first line, :func:`cona.engine.trainer.gns_due`): on an
unmeasured step the hooks return at once (where a step has pieces only when measured, they are not even
installed) and the difference estimator forgets its previous gradient, so an estimate always pairs two
consecutive steps. The norms stay device tensors; nothing here waits for the device.

Squared norms of sharded tensors are summed over shards; a tensor replicated over r of the ranks that sum
it is weighted 1/r, so nothing is double counted; pipeline stages add up in the same all-reduce. The tied
embedding/LM-head matrix is left out of both norms in every layout: under pp > 1 its per-micro-batch
gradient is split over two ranks (embedding part and head part) and the cross term is not available, so
including it would make the estimate depend on the layout.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.hooks import RemovableHandle

TIED_NAMES = ("tok_embeddings.weight", "output.weight")


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def shard_count(tensor: torch.Tensor) -> int:
    """How many distinct pieces the tensor is cut into across the ranks of its mesh (1 for a plain tensor)."""
    if not isinstance(tensor, DTensor):
        return 1
    count = 1
    for size, placement in zip(tensor.device_mesh.shape, tensor.placements, strict=True):
        if not isinstance(placement, Replicate):
            count *= size
    return count


def is_tied(name: str) -> bool:
    """Whether ``name`` is the token-embedding matrix that the LM head shares."""
    return name in TIED_NAMES


class MicroBatchNormMeter:
    """Sums ``weight * |local grad|^2`` of every micro-batch's gradient, per rank, into one device scalar.

    ``ranks_per_copy`` is the number of ranks that hold pieces of one dp rank's gradient of a stage (the TP
    degree): a plain tensor is replicated over them and weighted ``1 / ranks_per_copy``.
    """

    def __init__(
        self,
        modules: Iterable[nn.Module],
        *,
        ranks_per_copy: int,
        device: torch.device,
        via_forward_hooks: bool,
    ) -> None:
        self.ranks_per_copy = ranks_per_copy
        self.total = torch.zeros((), device=device, dtype=torch.float32)
        self.factor = 1.0
        self.active = True
        # id -> weak reference: tensors cannot go in a (Weak)Set, whose lookups compare them with ==.
        self._seen: dict[int, weakref.ref] = {}
        self._handles: list[RemovableHandle] = []
        for module in modules:
            if via_forward_hooks:
                self._handles.append(module.register_forward_pre_hook(self._hook_installed_parameters))
            else:
                self._hook_parameters(module)

    def remove(self) -> None:
        """Take every hook off again (the sum stays 0 afterwards)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._seen.clear()

    def start_step(self, grad_factor: float, *, active: bool = True) -> None:
        """Zero the sum; ``grad_factor`` converts what the hooks see into the micro-batch mean gradient.
        With ``active`` False the hooks of this step add nothing (and cost no kernel)."""
        self.total.zero_()
        self.factor = grad_factor
        self.active = active

    def hook(self, module: nn.Module) -> None:
        """Put the hooks on ``module``'s parameters (again after :meth:`remove`)."""
        self._hook_parameters(module)

    def _hook_parameters(self, module: nn.Module) -> None:
        for name, param in module.named_parameters():
            known = self._seen.get(id(param))
            if param.requires_grad and not is_tied(name) and (known is None or known() is not param):
                self._seen[id(param)] = weakref.ref(param)
                self._handles.append(param.register_hook(self._accumulate))

    @torch.compiler.disable
    def _hook_installed_parameters(self, module: nn.Module, args: object) -> None:
        self._hook_parameters(module)

    def _accumulate(self, grad: torch.Tensor) -> None:
        if not self.active:
            return
        if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
            # Sequence-parallel norm weights: each TP rank holds a partial sum of this gradient.
            with torch.no_grad():
                grad = grad.redistribute(
                    placements=[Replicate() if p.is_partial() else p for p in grad.placements]
                )
        # The weight follows the gradient's own placements, which may differ from its parameter's.
        weight = shard_count(grad) / self.ranks_per_copy
        norm = torch.linalg.vector_norm(local_tensor(grad), dtype=torch.float32)
        self.total.add_(norm.square(), alpha=weight * self.factor**2)


class PreviousGradient:
    """The difference estimator's memory: the last step's gradient tensors (GNS parameters only).

    They are kept by reference, not copied: the engine sets ``.grad`` to None before every step, so
    nothing else writes them, except clipping, whose factor is recorded (:meth:`note_scaled`) and divided
    out. Each measured step then costs one fused in-place add and one norm over the gradients, plus one
    in-place division when the clipping factor is a device tensor (it is not known on the host, and a
    Python factor is needed to fold it into the add).

    With ``copies`` (CUDA graphs: a step's gradients live in the graph's memory, which the next replay
    overwrites) the gradients are copied into buffers kept for the whole run, before clipping touches them.
    """

    def __init__(self, *, copies: bool = False) -> None:
        self.copies = copies
        self.grads: list[torch.Tensor] | None = None
        self.sqr: float | torch.Tensor | None = None
        self.scale: float | torch.Tensor = 1.0
        self._buffers: list[torch.Tensor] | None = None

    def forget(self) -> None:
        """Drop the held gradient (the next estimate starts afresh); copy buffers are kept for reuse."""
        self.grads, self.sqr, self.scale = None, None, 1.0

    def note_scaled(self, factor: float | torch.Tensor) -> None:
        """The gradients were multiplied by ``factor`` in place (gradient clipping); held copies were not."""
        if self.grads is not None and not self.copies:
            self.scale = self.scale * factor

    def sum_sqr(self, grads: list[torch.Tensor], weights: torch.Tensor) -> torch.Tensor:
        """Weighted local ``|previous + current|^2`` (zero without a previous gradient).

        Consumes the held tensors: ``held + scale * current = scale * (previous + current)``.
        """
        if self.grads is None:
            return torch.zeros((), device=weights.device)
        scale_sqr = 1.0
        if isinstance(self.scale, torch.Tensor):
            torch._foreach_div_(self.grads, self.scale.to(self.grads[0].dtype))
            torch._foreach_add_(self.grads, grads)
        else:
            torch._foreach_add_(self.grads, grads, alpha=self.scale)
            scale_sqr = self.scale**2
        norms = torch.stack(torch._foreach_norm(self.grads)).float()
        return (norms.square() * weights).sum() / scale_sqr

    def hold(self, grads: list[torch.Tensor], sqr: float | torch.Tensor) -> None:
        if self.copies:
            if self._buffers is None or len(self._buffers) != len(grads):
                self._buffers = [torch.empty_like(grad) for grad in grads]
            torch._foreach_copy_(self._buffers, grads)
            grads = self._buffers
        self.grads, self.sqr, self.scale = list(grads), sqr, 1.0


def difference_estimate(
    previous_sqr: float | torch.Tensor | None,
    current_sqr: float | torch.Tensor,
    sum_sqr: float | torch.Tensor,
    batch: int,
) -> tuple[float | torch.Tensor, float | torch.Tensor, int, int]:
    """(small_sqr, big_sqr, small_batch, big_batch) from two consecutive gradients of ``batch`` samples.

    ``sum_sqr`` is ``|previous + current|^2``, so the big batch's mean gradient has ``sum_sqr / 4``. Without
    a previous gradient there is no estimate: both norms are NaN (a consumer skips non-finite inputs).
    """
    if previous_sqr is None:
        return math.nan, math.nan, batch, 2 * batch
    return (previous_sqr + current_sqr) / 2, sum_sqr / 4, batch, 2 * batch
