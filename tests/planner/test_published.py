"""The performance model on published iteration times: the targets, and a multi-node data-parallel check."""

from __future__ import annotations

from cona.planner.published import TARGET, error_summary, korthikanti_points, narayanan_points


def test_the_model_meets_the_targets_on_every_published_point():
    korthikanti, narayanan = korthikanti_points(), narayanan_points()
    mean, largest = error_summary([*korthikanti, *narayanan])
    assert len(korthikanti) == 8 and len(narayanan) == 4
    assert mean <= TARGET[0] and largest <= TARGET[1]


def test_the_data_parallel_points_span_nodes_and_are_met():
    points = narayanan_points()
    assert all(p.strategy.dp == 32 and p.strategy.pp == 1 for p in points)
    assert all(p.strategy.world_size > 8 for p in points)  # several DGX nodes: dp crosses InfiniBand
    assert error_summary(points)[1] <= TARGET[1]


def test_the_measured_time_is_the_papers_flop_count_over_its_rate():
    first = narayanan_points()[0]  # 1.7B on 32 GPUs at 137 teraFLOP/s per GPU, batch 512
    flops = 96 * 512 * 2048 * 24 * 2304**2 * (1 + 2048 / (6 * 2304) + 51200 / (16 * 24 * 2304))
    assert first.measured_s == flops / (32 * 137e12)
