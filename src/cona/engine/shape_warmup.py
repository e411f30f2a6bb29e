"""Which steps still warm up a forward shape, so that their metrics line is not read as a steady rate.

A forward shape's first runs cost more than the later ones: eager, the allocator grows and the kernels load;
compiled, the graph is built; under CUDA graphs, the first call of each batch size runs plain and the second
records the graph (cudagraph trees). The first metrics line of a stage always holds its first step, but a
run's first line measures the gradient noise on every step, as pieces of the micro-batch, so the whole
micro-batch's second run falls in the second line: on the H200, compiled with CUDA graphs, GPT-350M's second
line ran 88 ms a step at gbs 8 and its third 30 ms, and the online search took the 88 ms for gbs 8's rate.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable

WARMUP_RUNS = {"eager": 1, "compiled": 1, "cuda_graphs": 2}
"""Runs of one shape that still cost more than a steady run, per way of running it."""


class ShapeWarmup:
    """Counts the runs of each (shape, way of running); a step that made a run still within
    :data:`WARMUP_RUNS` of its shape is a warm-up step."""

    def __init__(self) -> None:
        self._runs: Counter[tuple[Hashable, str]] = Counter()
        self._step_warmed_up = False

    def start_step(self) -> None:
        self._step_warmed_up = False

    def note(self, shape: Hashable, mode: str) -> None:
        """One forward (and its backward) of ``shape`` run ``mode`` (a key of :data:`WARMUP_RUNS`)."""
        key = (shape, mode)
        if self._runs[key] < WARMUP_RUNS[mode]:
            self._step_warmed_up = True
        self._runs[key] += 1

    @property
    def step_warmed_up(self) -> bool:
        """Whether the step since :meth:`start_step` ran a shape within its warm-up runs."""
        return self._step_warmed_up


def run_mode(*, compiled: bool, eager: bool, cuda_graphs: bool) -> str:
    """The key of :data:`WARMUP_RUNS` for a forward: ``eager`` where the model is not compiled or the step
    runs it eager (pieces the compiled graph cannot take)."""
    if eager or not compiled:
        return "eager"
    return "cuda_graphs" if cuda_graphs else "compiled"
