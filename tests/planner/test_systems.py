"""System files: every shipped one loads, bad input is refused with one line, collective formulas by hand."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cona.errors import PlanError
from cona.planner import systems
from cona.planner.systems import devices_mismatch, load_system

SHIPPED = ("a100_80g", "a100_80g_2gpu_node", "h100_80g", "h200_141g", "a6000_48g_pcie", "cpu_gloo")


def test_every_required_system_ships_with_sources():
    assert set(SHIPPED) <= set(systems.available_systems())
    for name in SHIPPED:
        system = systems.load_system(name)
        assert system.name == name
        assert system.sources and system.comment
        assert system.gpu.memory_gib > system.gpu.reserved_gib


def test_unknown_system_lists_the_available_ones():
    with pytest.raises(PlanError) as info:
        systems.load_system("a100_40g")
    message = str(info.value)
    assert "a100_40g" in message and "\n" not in message
    for name in SHIPPED:
        assert name in message


def test_system_file_by_path_and_bad_keys(tmp_path):
    raw = json.loads(
        systems.resources.files("cona.planner").joinpath("systems").joinpath("a100_80g.json").read_text()
    )
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(raw))
    assert systems.load_system(str(path)).gpus_per_node == 8
    raw["network"]["intra_node"]["efficiency"] = 1.5
    path.write_text(json.dumps(raw))
    with pytest.raises(PlanError, match="network.intra_node.efficiency"):
        systems.load_system(str(path))
    raw["network"]["intra_node"]["efficiency"] = 0.7
    del raw["gpu"]["vector_tflops"]["fp32"]
    path.write_text(json.dumps(raw))
    with pytest.raises(PlanError, match="gpu.vector_tflops: needs a rate for each dtype"):
        systems.load_system(str(path))
    raw["gpu"]["memory_gbs"] = 1
    path.write_text(json.dumps(raw))
    with pytest.raises(PlanError, match="gpu.memory_gbs: unknown key"):
        systems.load_system(str(path))
    with pytest.raises(PlanError, match="does not exist"):
        systems.load_system(str(tmp_path / "missing.json"))


def test_cpu_system_always_trains_in_fp32_and_gpus_refuse_unknown_dtypes():
    assert systems.load_system("cpu_gloo").resolve_dtype("bf16") == "fp32"
    assert systems.load_system("h100_80g").resolve_dtype("bf16") == "bf16"
    with pytest.raises(PlanError, match="no fp8 rate"):
        systems.load_system("h100_80g").resolve_dtype("fp8")


def test_efficiency_curve_interpolates_in_log_size_and_clamps():
    curve = systems.EfficiencyCurve(sizes=(1.0, 100.0), efficiencies=(0.2, 0.8))
    assert curve(np.array([0.01, 1.0, 10.0, 100.0, 1e6])) == pytest.approx([0.2, 0.2, 0.5, 0.8, 0.8])


def test_ring_all_reduce_and_all_gather_by_hand():
    nbytes, n, bandwidth, latency = 1e9, 8, 100e9, 1e-5
    expected = 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * latency
    assert systems.all_reduce_time(nbytes, n, bandwidth, latency) == pytest.approx(expected)
    assert systems.all_gather_time(nbytes, n, bandwidth, latency) == pytest.approx(expected / 2)
    assert systems.all_reduce_time(nbytes, 1, bandwidth, latency) == 0.0


def test_groups_within_a_node_use_the_fast_link_and_share_the_nic_across_nodes():
    system = systems.load_system("a100_80g")  # 8 per node, 300 GB/s x 0.75 inside, 200 GB/s x 0.85 per node
    bandwidth, latency = systems.group_bandwidth(system, np.array([8, 16, 2, 4]), np.array([1, 1, 8, 4]))
    intra, node = 300e9 * 0.75, 200e9 * 0.85
    assert bandwidth[0] == pytest.approx(intra) and latency[0] == system.intra_node.latency_s
    assert bandwidth[1] == pytest.approx(node)  # 8 members per node: the whole NIC
    assert bandwidth[2] == pytest.approx(node / 8)  # one member per node: 8 such groups share the NIC
    assert bandwidth[3] == pytest.approx(node * 2 / 8)
    assert latency[1] == system.inter_node.latency_s


def test_a_system_that_does_not_describe_the_run_s_devices_is_named():
    cpu, a100 = load_system("cpu_gloo"), load_system("a100_80g_2gpu_node")
    assert devices_mismatch(cpu, "cpu") is None
    assert devices_mismatch(a100, "cuda", ["NVIDIA A100-SXM4-80GB"] * 2) is None
    assert devices_mismatch(a100, "cuda") is None  # the node's GPUs unknown: nothing tells
    assert devices_mismatch(a100, "cpu").startswith(
        "--system a100_80g_2gpu_node describes GPUs, but this run trains on the CPU"
    )
    assert devices_mismatch(cpu, "cuda", ["NVIDIA H100 80GB HBM3"]).startswith(
        "--system cpu_gloo describes CPU workers, but this run trains on GPUs"
    )
    assert devices_mismatch(a100, "cuda", ["NVIDIA H100 80GB HBM3"]).startswith(
        "--system a100_80g_2gpu_node describes A100 GPUs, but this node has NVIDIA H100 80GB HBM3"
    )
