"""The loss of a step: the mean token cross entropy over every loss token of the whole global batch.

A loss token is a target other than ``IGNORE_INDEX``: every token for GPT and Llama, the masked positions
for BERT. With ``N`` loss tokens in the global batch and ``n = dp * micro_batches`` micro-batches in it,
micro-batch ``k`` contributes ``L_k = n * S_k / N``, where ``S_k`` is its summed token loss. The engine's
plumbing is unchanged by this: the plain path back-propagates ``L_k / micro_batches``, the pipeline
schedule scales by ``1 / micro_batches``, data parallelism averages over ``dp``, the reported loss is the mean
of the ``L_k`` over all ranks, and all of these give ``sum_k S_k / N`` and its gradient: the same function
under every layout (the parity rule), whatever the micro-batches' loss-token counts are. A mean of
per-micro-batch means would weight a token of a micro-batch with few masked positions more than one of a
micro-batch with many, and so would change with mbs and dp.

``N`` is counted on the device from the targets and summed over the dp group (one all-reduce of a scalar,
no host sync); every tp and pp rank of a dp rank holds the same targets. When every target counts and
``mbs * seq`` is a power of two, ``n / N`` is exactly ``1 / (mbs * seq)`` and ``L_k`` is bit for bit
PyTorch's mean-reduced cross entropy (GPT's loss before this normalisation existed).

Gradient-noise inputs (:mod:`cona.engine.gns`): a small-batch gradient is that of ``L_k``, i.e. the
micro-batch's mean-loss gradient weighted by ``count_k / (N / n)``, its loss tokens over the mean count.
The weights average exactly 1 over a step, so the small gradients still average to the big one, as the
estimator assumes; the big-batch norm is exact. For GPT every weight is exactly 1. For BERT every sample
has ``round(0.15 * m)`` masked positions, ``m`` its ordinary tokens (:mod:`cona.data.masking`), so counts
differ only by the [SEP] document separators and [UNK] a sample holds (with the demo data, ~5 separators
in 510 tokens: weights within ~1% of 1), and the small-batch norm is that of a mean over
``count_k`` tokens scaled by that weight.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cona.engine.model import IGNORE_INDEX


def summed_token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of the token cross entropies in fp32 over the loss tokens (logits may be bf16, or vocab-sharded
    DTensors under loss_parallel, whose ``sum`` reduction is replicated over the TP mesh)."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def loss_token_count(targets: list[torch.Tensor], dp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """Loss tokens of ``targets`` summed over the dp group (int64 device scalar; None: no dp peers)."""
    count = torch.stack([(t != IGNORE_INDEX).sum() for t in targets]).sum()
    if dp_group is not None:
        dist.all_reduce(count, group=dp_group)
    return count


def micro_batch_share(count: torch.Tensor, micro_batches_in_total: int) -> torch.Tensor:
    """``n / N`` as an fp32 device scalar: multiplies a micro-batch's summed loss into its ``L_k``.

    Computed in float64 so that it is exact where it can be (a power-of-two ``N / n``). A batch without
    any loss token has ``S_k = 0`` everywhere; ``N`` is then taken as 1 so the loss is 0, not NaN.
    """
    return (micro_batches_in_total / count.clamp(min=1).double()).float()
