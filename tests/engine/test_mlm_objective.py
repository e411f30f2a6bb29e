"""The loss is the global mean over the loss tokens of the whole global batch: BERT micro-batches with
unequal masked counts give the same loss, gradients and eval loss under every split (mbs x micro-batches,
dp, tp, pp), and GPT's loss is unchanged."""

from __future__ import annotations

import json

import pytest
import torch
from tests.helpers.paths import WORKERS
from tests.helpers.tiny import tiny_config, tiny_engine
from tests.helpers.torchrun_util import run_torchrun
from tests.helpers.workers.mlm_objective_worker import (
    TARGETS_PER_ROW,
    masked_batch,
    parse_layout,
    reference,
    run_layout,
    tiny_bert_config,
)

from cona.engine.model import token_cross_entropy
from cona.engine.objective import loss_token_count, micro_batch_share

WORKER = str(WORKERS / "mlm_objective_worker.py")
GBS = len(TARGETS_PER_ROW)


def check(result: dict) -> None:
    assert result["loss"] == pytest.approx(result["ref_loss"], rel=1e-6), result
    assert result["eval_loss"] == pytest.approx(result["ref_loss"], rel=1e-6), result
    assert result["max_grad_diff"] < 1e-6, result
    if result["ref_small_sqr"] is not None:
        assert result["gns_small_sqr"] == pytest.approx(result["ref_small_sqr"], rel=1e-5), result


def test_the_batch_tells_a_global_mean_from_a_mean_of_means() -> None:
    """Otherwise the tests below could not fail: per-row means average to something else."""
    config = tiny_bert_config()
    ref = reference(config, *masked_batch(config), n_small=GBS)
    assert abs(ref["mean_of_row_means"] - ref["loss"]) > 1e-3


@pytest.mark.parametrize("mbs", [1, 2, 4])
def test_every_micro_batch_split_computes_the_global_masked_mean(one_process_group, mbs: int) -> None:
    """mbs 1 x 4, 2 x 2 and 4 x 1 on one process (mbs 1 has a micro-batch without any masked token)."""
    _, strategy = parse_layout(f"mbs{mbs}:mbs={mbs}")
    check(run_layout(strategy, tiny_bert_config()))


def test_gpt_loss_is_still_the_mean_of_micro_batch_means(one_process_group) -> None:
    """Every target counts: the share n / N is exactly 1 / (mbs * seq), so L_k is the micro-batch mean."""
    engine = tiny_engine(gbs=6, mbs=3, config=tiny_config(model={"seq": 12}))
    tokens = torch.randint(0, 64, (6, 13), generator=torch.Generator().manual_seed(0))
    batches = list(zip(tokens[:, :-1].split(3), tokens[:, 1:].split(3), strict=True))
    out = engine.train_step_pending(batches).result()
    with torch.no_grad():
        means = [token_cross_entropy(engine.model_parts[0](i), t).item() for i, t in batches]
    assert out.loss == pytest.approx(sum(means) / 2, rel=1e-7)
    share = micro_batch_share(loss_token_count([t for _, t in batches], None), 2)
    assert share.item() == torch.tensor(1 / 36, dtype=torch.float32).item()  # 1 / (mbs * seq), rounded once


@pytest.mark.slow
@pytest.mark.multiproc
def test_data_tensor_and_pipeline_parallel_compute_the_global_masked_mean() -> None:
    layouts = {
        "dp2_zero0": "dp=2,zero_stage=0",
        "dp2_fsdp_mbs2": "dp=2,mbs=2",
        "tp2": "tp=2",
        "pp2": "pp=2",
    }
    done = run_torchrun([WORKER, *(f"{name}:{spec}" for name, spec in layouts.items())], 2, timeout=150)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = [
        json.loads(line.removeprefix("MLM ")) for line in done.stdout.splitlines() if line.startswith("MLM ")
    ]
    assert {r["layout"] for r in results} == set(layouts), done.stdout[-2000:]
    for result in results:
        check(result)
