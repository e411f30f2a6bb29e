"""Where the metrics of a stage go: ``metrics.jsonl`` (what the runner and the search read; its schema is
:class:`cona.metrics_record.MetricsRecord`), TensorBoard (the same scalars, when configured) and one console
line per log interval. Rank 0 only. W&B gets them from the runner, which follows ``metrics.jsonl``
(:mod:`cona.runner.views.run_tracker`): one process writes a run's one W&B run, however many stages it has.

Also the device peak table behind ``mfu`` (model FLOPs utilisation): achieved model FLOP/s over the peak
dense FLOP/s of the GPUs in use, with the model FLOPs of :func:`cona.planner.flops.training_flops_per_token`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any, Protocol

from rich.console import Console

from cona.config import TrainingConfig
from cona.errors import ConfigError
from cona.metrics_record import MASKED_TOKENS

# Peak dense (no sparsity) tensor-core TFLOP/s by dtype, from the vendors' datasheets. "fp32" is plain
# fp32 (no TF32), which is what PyTorch uses for fp32 matmuls by default. First match wins, so a more
# specific name comes before one it contains.
PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    (r"B200", {"bf16": 2250.0, "fp16": 2250.0, "fp32": 80.0}),
    (r"H200", {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0}),
    (r"H100.*PCIe", {"bf16": 756.0, "fp16": 756.0, "fp32": 51.0}),
    (r"H100", {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0}),
    (r"A100", {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}),
    (r"L40S", {"bf16": 362.0, "fp16": 362.0, "fp32": 91.6}),
    (r"\bL4\b", {"bf16": 121.0, "fp16": 121.0, "fp32": 30.3}),
    (r"V100", {"fp16": 125.0, "fp32": 15.7}),
)


# Metrics whose W&B/TensorBoard panel would be noise: identifiers and wall-clock stamps.
_NOT_SCALARS = frozenset({"stage", "iteration", "time"})


def peak_flops(device_name: str | None, dtype: str) -> float | None:
    """Peak FLOP/s of one device of this name in ``dtype``; None for a CPU or an unknown device."""
    if device_name is None:
        return None
    for pattern, rates in PEAK_TFLOPS:
        if re.search(pattern, device_name):
            rate = rates.get(dtype)
            return rate * 1e12 if rate is not None else None
    return None


def model_flops_utilization(
    tokens_per_s: float, flops_per_token: float, peak_flops_per_device: float | None, devices: int
) -> float | None:
    """Achieved model FLOP/s over the peak of all ``devices`` (None when the peak is unknown)."""
    if peak_flops_per_device is None or tokens_per_s <= 0:
        return None
    return tokens_per_s * flops_per_token / (peak_flops_per_device * devices)


class MetricsSink(Protocol):
    def write(self, record: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """Appends one JSON object per record and flushes, so a reader (the online search) sees it at once."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a")  # noqa: SIM115 (kept open for the whole stage)

    def write(self, record: Mapping[str, Any]) -> None:
        # JSON has no NaN/inf: a diverged loss is written as null rather than as invalid JSON.
        finite = {
            key: None if isinstance(value, float) and not math.isfinite(value) else value
            for key, value in record.items()
        }
        self._file.write(json.dumps(finite, allow_nan=False, default=_numpy_scalar) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class ConsoleSink:
    """One human-readable line per record, through rich (plain text when the stream is not a terminal)."""

    def __init__(self, stream: IO[str]) -> None:
        self._console = Console(file=stream, highlight=False, soft_wrap=True)

    def write(self, record: Mapping[str, Any]) -> None:
        self._console.print(format_console_line(record))

    def close(self) -> None:
        self._console.file.flush()


class TensorBoardSink:
    """TensorBoard events under ``<tensorboard_dir>/<run_name>``."""

    def __init__(self, *, directory: str, run_name: str) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError(
                "training.tensorboard_dir is set but tensorboard is not installed "
                "(pip install 'cona[tracking]')"
            ) from None
        self._writer = SummaryWriter(log_dir=str(Path(directory) / run_name))

    def write(self, record: Mapping[str, Any]) -> None:
        for key, value in scalars(record).items():
            self._writer.add_scalar(key, value, global_step=int(record["iteration"]))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class MetricsLogger:
    """Sends each record to every sink."""

    def __init__(self, sinks: list[MetricsSink]) -> None:
        self._sinks = sinks

    def write(self, record: Mapping[str, Any]) -> None:
        for sink in self._sinks:
            sink.write(record)

    def close(self) -> None:
        for sink in self._sinks:
            sink.close()


def build_metrics_logger(
    *,
    metrics_path: Path,
    training: TrainingConfig,
    run_name: str,
    console: IO[str] | None,
) -> MetricsLogger:
    """The sinks this config asks for (call on rank 0 only)."""
    sinks: list[MetricsSink] = [JsonlSink(metrics_path)]
    if console is not None:
        sinks.append(ConsoleSink(console))
    if training.logging.tensorboard_dir is not None:
        sinks.append(TensorBoardSink(directory=training.logging.tensorboard_dir, run_name=run_name))
    return MetricsLogger(sinks)


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The plottable numbers of a record (finite numbers other than identifiers and time stamps) under
    their tracker tags: ``eval/<name>`` for an ``eval_<name>`` key, ``train/<key>`` for every other, so
    TensorBoard and W&B show the training and the evaluation curves in sections of their own."""
    return {
        tracker_tag(key): float(value)
        for key, value in record.items()
        if key not in _NOT_SCALARS
        and isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
    }


def tracker_tag(key: str) -> str:
    """``eval_loss`` -> ``eval/loss``, ``loss`` -> ``train/loss``."""
    return f"eval/{key.removeprefix('eval_')}" if key.startswith("eval_") else f"train/{key}"


def eval_ppl_label(record: Mapping[str, Any]) -> str:
    """What a record's ``eval_ppl`` is a perplexity of: BERT's counts only the masked tokens."""
    return "masked-token ppl" if record.get("eval_ppl_tokens") == MASKED_TOKENS else "ppl"


def format_console_line(record: Mapping[str, Any]) -> str:
    parts = [
        f"stage {record['stage']} iter {record['iteration']:>6}",
        f"loss {record['loss']:.4f}",
        f"lr {record['lr']:.2e}",
        f"{record['step_time_s']:.3f} s/it",
        f"{record['tokens_per_s']:,.0f} tok/s",
    ]
    if record.get("mfu") is not None:
        parts.append(f"mfu {100 * record['mfu']:.1f}%")
    parts.append(f"gnorm {record['grad_norm']:.3f}")
    parts.append(f"{record['consumed_tokens']:,} tokens")
    if record.get("eval_loss") is not None:
        parts.append(f"eval {record['eval_loss']:.4f} {eval_ppl_label(record)} {record['eval_ppl']:.2f}")
    return " | ".join(parts)


def _numpy_scalar(value: Any) -> Any:
    """JSON fallback for numpy scalars; anything else is a bug in the caller."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"metrics value of type {type(value).__name__} is not JSON-serialisable")
