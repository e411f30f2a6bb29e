"""Published iteration times the performance model is judged on, and its error on them (pure numpy).

Two sources, both Megatron-LM on Selene (DGX A100 80GB: 8 GPUs per node on NVSwitch, 8 x 200 Gb/s HDR
InfiniBand per node), seq 2048, vocab 51200, fp16, predicted with the ``megatron-deepspeed`` profile on the
``a100_80g`` system file with nothing fitted on them:

* Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", Table 5: 8
  iteration times (4 models x full recomputation / selective recomputation with sequence parallelism), dp =
  1, layouts as in Calculon's ``validation/seqsel/tab5`` files.
* Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"
  (SC'21), Table 1 (weak scaling): the rows without pipeline parallelism, where data parallelism of 32 spans
  4 to 32 nodes (1.7B to 18.4B parameters, tp 1 to 8). The table gives achieved teraFLOP/s per GPU ``X``;
  the iteration time is the paper's own FLOP count (its eq. 3, full activation recomputation) over the
  GPUs' rate, ``96 B s l h^2 (1 + s / 6h + V / 16lh) / (n X)``. It gives no micro-batch size: the
  authors tune it for throughput (their Section 3.4), so each row is predicted at the model's fastest
  micro-batch among 1, 2, 4 and 8 that fits in memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cona.config import ModelConfig
from cona.planner.perf_model import predict
from cona.planner.systems import load_system
from cona.strategy import Strategy

SEQ, VOCAB = 2048, 51200
PROFILE = "megatron-deepspeed"
SYSTEM = "a100_80g"
TARGET = (0.05, 0.10)
"""Mean and largest |error| the model must meet on the published points, with nothing fitted on them."""

# (name, layers, hidden, heads, tp, pp, mbs, gbs, virtual stages, measured s: full recompute, selective + SP)
KORTHIKANTI_TABLE5 = (
    ("22B", 48, 6144, 64, 8, 1, 4, 4, 1, 1.42, 1.10),
    ("175B", 96, 12288, 96, 8, 8, 1, 64, 3, 18.13, 13.75),
    ("530B", 105, 20480, 128, 8, 35, 1, 280, 3, 49.05, 37.83),
    ("1T", 128, 25600, 160, 8, 64, 1, 512, 1, 94.42, 71.49),
)
# (name, heads, hidden, layers, tp, GPUs, global batch, achieved teraFLOP/s per GPU); pp = 1, dp = GPUs / tp.
NARAYANAN_TABLE1_DP = (
    ("1.7B", 24, 2304, 24, 1, 32, 512, 137.0),
    ("3.6B", 32, 3072, 30, 2, 64, 512, 138.0),
    ("7.5B", 32, 4096, 36, 4, 128, 512, 142.0),
    ("18.4B", 48, 6144, 40, 8, 256, 1024, 135.0),
)
MICRO_BATCHES = (1, 2, 4, 8)


@dataclass(frozen=True, kw_only=True)
class PublishedPoint:
    label: str
    source: str
    model: ModelConfig
    strategy: Strategy
    measured_s: float
    predicted_s: float

    @property
    def error(self) -> float:
        """``predicted / measured - 1``."""
        return self.predicted_s / self.measured_s - 1.0


def korthikanti_points() -> list[PublishedPoint]:
    system, points = load_system(SYSTEM), []
    for name, layers, hidden, heads, tp, pp, mbs, gbs, v, full_s, selective_s in KORTHIKANTI_TABLE5:
        model = ModelConfig(layers=layers, hidden=hidden, heads=heads, seq=SEQ, vocab_size=VOCAB)
        schedule = "interleaved_1f1b" if v > 1 else "1f1b"
        for recompute, sp, measured in (("full", False, full_s), ("selective", True, selective_s)):
            strategy = Strategy(
                dp=1, tp=tp, pp=pp, mbs=mbs, gbs=gbs, zero_stage=0, recompute=recompute, sequence_parallel=sp,
                pipeline_schedule=schedule, virtual_stages=v,
            )  # fmt: skip
            predicted = float(
                predict(model, strategy, system, dtype="fp16", backend=PROFILE).iteration_time_s[0]
            )
            points.append(
                PublishedPoint(
                    label=f"{name} {recompute}",
                    source="Korthikanti et al. 2022, Table 5",
                    model=model,
                    strategy=strategy,
                    measured_s=measured,
                    predicted_s=predicted,
                )  # fmt: skip
            )
    return points


def narayanan_points() -> list[PublishedPoint]:
    system, points = load_system(SYSTEM), []
    for name, heads, hidden, layers, tp, gpus, gbs, tflops in NARAYANAN_TABLE1_DP:
        model = ModelConfig(layers=layers, hidden=hidden, heads=heads, seq=SEQ, vocab_size=VOCAB)
        flops = (
            96 * gbs * SEQ * layers * hidden**2 * (1 + SEQ / (6 * hidden) + VOCAB / (16 * layers * hidden))
        )
        measured = flops / (gpus * tflops * 1e12)
        strategies = [
            Strategy(dp=gpus // tp, tp=tp, pp=1, mbs=mbs, gbs=gbs, zero_stage=0, recompute="full")
            for mbs in MICRO_BATCHES
        ]
        predictions = [predict(model, s, system, dtype="fp16", backend=PROFILE) for s in strategies]
        fitting = [(float(p.iteration_time_s[0]), s) for p, s in zip(predictions, strategies, strict=True)
                   if not bool(p.oom[0])]  # fmt: skip
        predicted, strategy = min(fitting, key=lambda pair: pair[0])
        points.append(
            PublishedPoint(
                label=f"{name} dp{gpus // tp} tp{tp} ({gpus // system.gpus_per_node} nodes)",
                source="Narayanan et al. 2021, Table 1",
                model=model,
                strategy=strategy,
                measured_s=measured,
                predicted_s=predicted,
            )  # fmt: skip
        )
    return points


def published_points() -> list[PublishedPoint]:
    """Every published point: Korthikanti's dp = 1 rows, then Narayanan's multi-node data-parallel rows."""
    return [*korthikanti_points(), *narayanan_points()]


def error_summary(points: list[PublishedPoint]) -> tuple[float, float]:
    """Mean and largest ``|predicted / measured - 1|``."""
    errors = np.abs([point.error for point in points])
    return float(errors.mean()), float(errors.max())
