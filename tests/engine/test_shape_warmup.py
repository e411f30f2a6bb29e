"""Steps that still warm up a forward shape are flagged, so that their metrics line is no steady rate."""

from __future__ import annotations

import torch
from tests.helpers.tiny import tiny_engine

from cona.engine.shape_warmup import ShapeWarmup, run_mode
from cona.metrics_record import MetricsRecord, stage_rates, steady_rates


def warmed_up(warmup: ShapeWarmup, *runs: tuple[tuple[int, ...], str]) -> bool:
    warmup.start_step()
    for shape, mode in runs:
        warmup.note(shape, mode)
    return warmup.step_warmed_up


def test_a_shape_warms_up_once_eager_and_compiled_and_twice_under_cuda_graphs() -> None:
    warmup = ShapeWarmup()
    assert warmed_up(warmup, ((8, 64), "eager")) and not warmed_up(warmup, ((8, 64), "eager"))
    assert warmed_up(warmup, ((4, 64), "eager"))  # another shape: warms up on its own
    assert warmed_up(warmup, ((8, 64), "compiled"))  # the same shape, another way of running it
    graphs = [warmed_up(warmup, ((8, 64), "cuda_graphs")) for _ in range(3)]
    assert graphs == [True, True, False]  # the first call runs plain, the second records the graph
    # A measured step's two pieces are two calls: under CUDA graphs they warm up in one step.
    assert warmed_up(warmup, ((4, 64), "cuda_graphs"), ((4, 64), "cuda_graphs"))
    assert not warmed_up(warmup, ((4, 64), "cuda_graphs"), ((4, 64), "cuda_graphs"))


def test_run_mode() -> None:
    assert run_mode(compiled=False, eager=False, cuda_graphs=True) == "eager"
    assert run_mode(compiled=True, eager=True, cuda_graphs=True) == "eager"
    assert run_mode(compiled=True, eager=False, cuda_graphs=False) == "compiled"
    assert run_mode(compiled=True, eager=False, cuda_graphs=True) == "cuda_graphs"


def test_the_engine_flags_the_first_step_of_each_shape(one_process_group) -> None:
    engine = tiny_engine(gbs=4, mbs=4)  # one micro-batch on one rank: a measured step runs it as pieces
    tokens = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(0))
    batch = [(tokens[:, :-1], tokens[:, 1:])]
    flags = []
    for measure in (False, False, True, True, False):
        engine.train_step_pending(batch, measure_gns=measure).result()
        flags.append(engine.shape_warmup.step_warmed_up)
    assert flags == [True, False, True, False, False]


def line(rate: float, warmup_steps: int | None = None) -> MetricsRecord:
    return MetricsRecord(stage=1, iteration=8, tokens_per_s=rate, warmup_steps=warmup_steps)


def test_a_line_that_warmed_up_a_shape_after_the_stage_s_first_is_no_rate() -> None:
    # GPT-350M compiled on the H200: the second line recorded gbs 8's CUDA graphs (88 ms a step, 30 later).
    lines = [line(446.0, 8), line(46_607.0, 1), line(138_590.0), line(139_000.0)]
    assert stage_rates(lines) == [446.0, 138_590.0, 139_000.0]
    assert steady_rates(stage_rates(lines[:2])) == []  # at the second line: nothing measured yet
    assert stage_rates([line(10.0), line(20.0, 2), line(30.0)]) == [10.0, 30.0]
    assert stage_rates([MetricsRecord(stage=1), line(5.0, 1)]) == [5.0]  # the first line with a rate stays
