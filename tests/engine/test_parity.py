"""Parity: one training step under each parallel layout equals the 1-process step on the same global batch.

Two torchrun launches (2 and 4 gloo processes) run all layouts of the GPT and, in the 2-process launch, for
each other family (Llama, BERT) a layout of each parallel dimension; each worker rank compares against the
plain model it computes itself (see parity_worker.py).
"""

from __future__ import annotations

import json

import pytest
from tests.helpers.paths import WORKERS
from tests.helpers.torchrun_util import run_torchrun

WORKER = str(WORKERS / "parity_worker.py")

TWO_PROCESS_LAYOUTS = {
    "dp2 zero0": "dp=2,zero_stage=0",
    "dp2 zero0 one micro-batch": "dp=2,zero_stage=0,gbs=4",
    "dp2 zero3 one micro-batch": "dp=2,zero_stage=3,gbs=4",
    "dp2 zero1": "dp=2,zero_stage=1",
    "dp2 zero3 full recompute": "dp=2,zero_stage=3,recompute=full",
    "tp2": "tp=2",
    "tp2 sequence parallel selective recompute": "tp=2,sequence_parallel=1,recompute=selective",
    "pp2 1f1b": "pp=2",
    "pp2 gpipe": "pp=2,pipeline_schedule=gpipe",
    "pp2 interleaved v2": "pp=2,pipeline_schedule=interleaved_1f1b,virtual_stages=2",
}
FOUR_PROCESS_LAYOUTS = {
    "dp2xtp2": "dp=2,tp=2",
    "dp2xpp2": "dp=2,pp=2",
    "tp2xpp2": "tp=2,pp=2",
    "dp2xtp2 sp zero3": "dp=2,tp=2,sequence_parallel=1,zero_stage=3",
    "dp2xpp2 zero0": "dp=2,pp=2,zero_stage=0",
    "dp2xpp2 interleaved v2": "dp=2,pp=2,pipeline_schedule=interleaved_1f1b,virtual_stages=2",
    "dp2xpp2 gpipe zero3 one micro-batch": "dp=2,pp=2,pipeline_schedule=gpipe,zero_stage=3,gbs=4",
}


FAMILY_LAYOUTS = {
    "dp2 zero3 full recompute": "dp=2,zero_stage=3,recompute=full",
    "tp2": "tp=2",
    "tp2 sequence parallel selective recompute": "tp=2,sequence_parallel=1,recompute=selective",
    "pp2 1f1b": "pp=2",
}
"""Llama and BERT: each parallel dimension (tp=2 splits llama's 2 key/value heads one per rank)."""


def run_layouts(groups: dict[str, dict[str, str]], nproc: int) -> dict[str, dict[str, dict]]:
    """The layouts of each family (``{family: {name: layout}}``) in one torchrun launch of ``nproc``
    processes; returns ``{family: {name: result}}``."""
    args = [WORKER]
    for family, layouts in groups.items():
        args += [f"family={family}", *(f"{name.replace(' ', '_')}:{spec}" for name, spec in layouts.items())]
    done = run_torchrun(args, nproc, timeout=150 * len(groups))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results: dict[str, dict[str, dict]] = {family: {} for family in groups}
    for line in done.stdout.splitlines():
        if line.startswith("PARITY "):
            result = json.loads(line.removeprefix("PARITY "))
            results[result["family"]][result["layout"].replace("_", " ")] = result
    for family, layouts in groups.items():
        assert set(results[family]) == set(layouts), (family, done.stdout[-2000:])
    return results


@pytest.fixture(scope="module")
def two_process_results() -> dict[str, dict[str, dict]]:
    """The 2-process layouts of every family, in one launch (one process start for the three tests below;
    the tests read the results only)."""
    return run_layouts({"gpt": TWO_PROCESS_LAYOUTS, "llama": FAMILY_LAYOUTS, "bert": FAMILY_LAYOUTS}, 2)


def relative(value: float, reference: float) -> float:
    return abs(value - reference) / abs(reference)


def check(result: dict) -> None:
    assert relative(result["loss"], result["ref_loss"]) < 1e-5, result
    assert relative(result["eval_loss"], result["ref_loss"]) < 1e-5, result
    assert relative(result["loss_after_eval"], result["loss"]) < 1e-6, result
    assert relative(result["gns_small_sqr_after_eval"], result["gns_small_sqr"]) < 1e-5, result
    assert relative(result["probe_loss"], result["ref_probe_loss"]) < 1e-5, result
    assert relative(result["norm"], result["ref_norm"]) < 1e-4, result
    assert result["max_grad_diff"] < 1e-6, result
    assert relative(result["gns_small_sqr"], result["ref_small_sqr"]) < 1e-4, result
    assert relative(result["gns_big_sqr"], result["ref_big_sqr"]) < 1e-4, result


@pytest.mark.slow
@pytest.mark.multiproc
def test_two_process_layouts_match_one_process(two_process_results) -> None:
    results = two_process_results["gpt"]
    for result in results.values():
        check(result)
    for name in ("dp2 zero0 one micro-batch", "dp2 zero3 one micro-batch"):  # measured as halves of 1 row
        assert results[name]["gns_small_batch"] == 1, results[name]


@pytest.mark.slow
@pytest.mark.multiproc
def test_four_process_layouts_match_one_process() -> None:
    for result in run_layouts({"gpt": FOUR_PROCESS_LAYOUTS}, 4)["gpt"].values():
        check(result)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("family", ["llama", "bert"])
def test_other_families_match_one_process(family: str, two_process_results) -> None:
    assert set(two_process_results[family]) == set(FAMILY_LAYOUTS)
    for result in two_process_results[family].values():
        check(result)
