"""Gradient-noise inputs inside a Megatron-DeepSpeed process: the sums of :mod:`cona.engine.gns`.

This file runs in the checkout's interpreter (torch only; CONA is not installed there), imported by
``cona_pretrain_gpt.py``. It measures what the native engine measures, with the same rules:

- small batch = one micro-batch of one dp rank. A tensor hook on every parameter sees each micro-batch's
  gradient before accumulation and before any data-parallel reduction (DeepSpeed scales the loss by
  ``1 / gradient_accumulation_steps`` before backward; ``grad_factor`` undoes it) and adds its squared norm.
- big batch = the global batch's mean gradient. DeepSpeed's ZeRO-1 consumes ``.grad`` into its own
  partitioned buffers, so no reduced full gradient is visible at a stable point; the hooks therefore also
  sum each measured step's micro-batch gradients into an fp32 buffer (one parameter-sized buffer per rank,
  only on measured steps), which one all-reduce over the data-parallel group turns into the global mean.
- weights: a parameter Megatron shards over tensor parallelism (``tensor_model_parallel``) counts 1, one it
  replicates over the tp ranks (norms, row-parallel biases) ``1 / tp``; pipeline stages add up in the same
  all-reduce over every rank. The tied word-embedding / LM-head matrix is left out of both norms, as in
  the native engine (under pp > 1 its gradient is split over two ranks).
- one small batch per step (dp = 1 and one micro-batch): the difference estimator of
  :func:`cona.engine.gns.difference_estimate` over two consecutive measured steps.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

TIED_SUFFIX = "word_embeddings.weight"
"""Megatron's token embedding (tied to the LM head): ``tied_modules.embed.word_embeddings.weight`` in the
pipe model, ``language_model.embedding.word_embeddings.weight`` (and a copy on the last stage) otherwise."""


def gns_parameters(named: Iterable[tuple[str, torch.nn.Parameter]]) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters both norms cover: every trained one except the tied embedding."""
    return [(name, p) for name, p in named if p.requires_grad and not name.endswith(TIED_SUFFIX)]


def tp_weight(param: torch.nn.Parameter, tp: int) -> float:
    """1 for a tensor-parallel shard, ``1 / tp`` for a tensor every tp rank holds whole."""
    return 1.0 if getattr(param, "tensor_model_parallel", False) else 1.0 / tp


class MicroBatchGns:
    """Per-rank sums of one step's micro-batch gradients; :meth:`finish_step` all-reduces them."""

    def __init__(self, named: Iterable[tuple[str, torch.nn.Parameter]], *, tp: int) -> None:
        self.params = [p for _, p in gns_parameters(named)]
        self.weights = [tp_weight(p, tp) for p in self.params]
        device = self.params[0].device if self.params else torch.device("cpu")
        self.device = device
        self.small = torch.zeros((), device=device, dtype=torch.float32)
        self.sums: list[torch.Tensor | None] = [None] * len(self.params)
        self.factor = 1.0
        self.active = False
        self.previous: torch.Tensor | None = None
        """The last measured step's global mean gradient (difference estimator, one small batch only)."""
        self.previous_sqr: float | None = None
        self.flat_weights = self._flat_weights()
        self.handles = [p.register_hook(self._hook(index)) for index, p in enumerate(self.params)]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def start_step(self, grad_factor: float, *, active: bool) -> None:
        """Before the step's backward passes; ``grad_factor`` turns a hook's gradient into the micro-batch
        mean gradient. An inactive step adds nothing and forgets the difference estimator's gradient."""
        self.small.zero_()
        self.sums = [None] * len(self.params)
        self.factor, self.active = grad_factor, active
        if not active:
            self.previous, self.previous_sqr = None, None

    def _hook(self, index: int):
        def accumulate(grad: torch.Tensor) -> None:
            if not self.active:
                return
            with torch.no_grad():
                micro = grad.detach().float() * self.factor
                self.small.add_(micro.square().sum(), alpha=self.weights[index])
                held = self.sums[index]
                self.sums[index] = micro if held is None else held.add_(micro)

        return accumulate

    def finish_step(
        self, *, micro_batches: int, dp: int, gbs: int, dp_group=None, world_group=None
    ) -> tuple[float, float, int, int]:
        """``(small_sqr, big_sqr, small_batch, big_batch)`` of the step, the same on every rank (NaN norms:
        no estimate, e.g. the first of two steps the difference estimator pairs)."""
        self.active = False
        local_mean = self._flat_sums() / micro_batches
        if dp > 1:
            torch.distributed.all_reduce(local_mean, group=dp_group)
        mean = local_mean / dp
        weights = self.flat_weights
        big_local = (mean.square() * weights).sum()
        n_small = dp * micro_batches
        if n_small > 1:
            sums = self._all_reduce(torch.stack([self.small, big_local]), world_group)
            return float(sums[0]) / n_small, float(sums[1]) / dp, gbs // n_small, gbs
        return self._difference(mean, weights, big_local, world_group, gbs)

    def _difference(self, mean, weights, current_local, world_group, gbs) -> tuple[float, float, int, int]:
        """Two consecutive one-small-batch steps: ``|g1|^2, |g2|^2`` against ``|(g1 + g2) / 2|^2``."""
        pair_local = ((self.previous + mean).square() * weights).sum() if self.previous is not None else None
        values = [current_local, pair_local if pair_local is not None else torch.zeros_like(current_local)]
        current_sqr, pair_sqr = (float(v) for v in self._all_reduce(torch.stack(values), world_group))
        previous_sqr = self.previous_sqr
        self.previous, self.previous_sqr = mean, current_sqr
        if previous_sqr is None:
            return math.nan, math.nan, gbs, 2 * gbs
        return (previous_sqr + current_sqr) / 2, pair_sqr / 4, gbs, 2 * gbs

    @staticmethod
    def _all_reduce(values: torch.Tensor, group) -> torch.Tensor:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(values, group=group)
        return values

    def _flat_sums(self) -> torch.Tensor:
        """Every parameter's summed micro-batch gradient in one vector (zeros where no gradient came: a
        parameter this stage did not use), so that the all-reduce lines up across dp ranks."""
        parts = [
            held.reshape(-1) if held is not None else torch.zeros(p.numel(), device=self.device)
            for held, p in zip(self.sums, self.params, strict=True)
        ]
        return torch.cat(parts) if parts else torch.zeros(0, device=self.device)

    def _flat_weights(self) -> torch.Tensor:
        parts = [
            torch.full((p.numel(),), w, device=self.device)
            for p, w in zip(self.params, self.weights, strict=True)
        ]
        return torch.cat(parts) if parts else torch.zeros(0, device=self.device)
