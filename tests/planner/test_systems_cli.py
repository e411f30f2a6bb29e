"""``cona systems``: every shipped system file is listed with the numbers the planner uses."""

from __future__ import annotations

import json

from cona.cli import main
from cona.planner.systems import available_systems, load_system


def test_systems_lists_every_shipped_file_with_its_numbers(capsys):
    assert main(["systems"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:2] == ["name", "GPUs/node"]
    by_name = {line.split()[0]: line for line in lines[1:]}
    assert sorted(by_name) == available_systems()
    h200 = load_system("h200_141g")
    columns = by_name["h200_141g"].split()
    assert columns[1] == str(h200.gpus_per_node)
    assert f"bf16 {h200.gpu.matrix_tflops['bf16']:g}," in by_name["h200_141g"]
    assert f"{h200.gpu.memory_gib:g}" in columns and "HGX H200" in by_name["h200_141g"]


def test_systems_json_is_one_object_per_system(capsys):
    assert main(["systems", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [row["name"] for row in rows] == available_systems()
    cpu = next(row for row in rows if row["name"] == "cpu_gloo")
    assert cpu["peak_tflops"] == {"fp32": load_system("cpu_gloo").gpu.matrix_tflops["fp32"]}
    assert cpu["gpus_per_node"] == load_system("cpu_gloo").gpus_per_node
