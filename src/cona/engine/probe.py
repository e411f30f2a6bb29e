"""The native engine's side of switch verification: the probe batch and its loss under this rank's layout.

The probe batch is the first :data:`PROBE_ROWS` samples of the validation split (of the test split, or
the train split, when the validation split has none): fixed by the data and ``model.seq`` alone, never by
gbs, mbs or dp, and small enough that its forward pass costs next to nothing next to a save or a load.
Every rank gets the whole batch (:meth:`TrainingModel.probe_loss`), so the loss is the same number under
every layout up to rounding. The comparison itself is :func:`cona.engine.switch_check.compare_probe`.
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

from cona.data.gpt_dataset import GPTDataset, Splits, collate
from cona.engine.checkpoint.state import gather, state_root
from cona.engine.switch_check import ProbeRecord
from cona.engine.train_model import TrainingModel

PROBE_ROWS = 4
"""Rows of the probe batch: enough tokens that the mean loss averages rounding, few enough to cost ~0."""


@dataclass(frozen=True, kw_only=True)
class ProbeBatch:
    split: str
    sample_ids: tuple[int, ...]
    inputs: torch.Tensor
    targets: torch.Tensor
    tokens_sha256: str


def probe_batch(splits: Splits, *, rows: int = PROBE_ROWS) -> ProbeBatch:
    """The fixed probe batch of a run's data (the same on every rank and in every stage)."""
    name, dataset = _probe_split(splits)
    ids = np.arange(min(rows, len(dataset)), dtype=np.int64)
    inputs, targets = collate(dataset, ids)
    digest = hashlib.sha256(inputs.numpy().tobytes() + targets.numpy().tobytes()).hexdigest()
    return ProbeBatch(
        split=name,
        sample_ids=tuple(int(i) for i in ids),
        inputs=inputs,
        targets=targets,
        tokens_sha256=digest,
    )


def _probe_split(splits: Splits) -> tuple[str, GPTDataset]:
    for name in ("valid", "test"):
        dataset = getattr(splits, name)
        if dataset is not None:
            return name, dataset
    return "train", splits.train  # never empty: building the datasets refuses that


def measure_probe(model: TrainingModel, batch: ProbeBatch, *, iteration: int) -> ProbeRecord:
    """Collective: the probe loss of the model's current weights and each tensor's largest magnitude (the
    same values on every rank)."""
    began = time.perf_counter()
    # Its all-reduce and host read wait for every rank and the device: the time covers the whole check.
    loss = model.probe_loss(batch.inputs, batch.targets)
    max_abs = tensor_max_abs(model.model_parts)
    seconds = time.perf_counter() - began
    return ProbeRecord(
        loss=loss,
        dtype=model.dtype,
        layout=model.strategy.short(),
        iteration=iteration,
        split=batch.split,
        sample_ids=batch.sample_ids,
        tokens_sha256=batch.tokens_sha256,
        seconds=seconds,
        tensor_max_abs=max_abs,
    )


def tensor_max_abs(model_parts: list[torch.nn.Module]) -> dict[str, float]:
    """Collective: each model tensor's largest magnitude (NaN or inf where it holds one), by its checkpoint
    name. Each rank takes the maximum of its own shard; the maximum over the ranks holding the tensor is the
    tensor's, however it is sharded or replicated."""
    state = get_model_state_dict(state_root(model_parts))
    local = {}
    for name, tensor in state.items():
        values = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if torch.is_floating_point(values) and values.numel():
            local[name] = values.detach().abs().amax()
    names = sorted(local)
    stacked = torch.stack([local[name].float() for name in names]).cpu().tolist() if names else []
    mine = dict(zip(names, stacked, strict=True))
    combined: dict[str, float] = {}
    for theirs in gather(mine):
        for name, value in theirs.items():
            old = combined.get(name)
            combined[name] = value if old is None or math.isnan(value) or value > old else old
    return combined
