"""CONA's hooks inside Megatron-DeepSpeed processes (``launched/``), against a small Megatron-like model.

The model names its tied embedding as Megatron's pipe model does and marks tensor-parallel shards with
``tensor_model_parallel``; the step is run as DeepSpeed runs it (each micro-batch's loss divided by the
accumulation steps before backward). The sums must be the native engine's (:mod:`cona.engine.gns`).
"""

from __future__ import annotations

import io
import math
import os
import sys
from contextlib import redirect_stdout
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from cona.backends.megatron_deepspeed.environment import LAUNCHED_DIR
from cona.backends.megatron_deepspeed.log_parse import MetricsRecorder
from cona.engine.gns import MicroBatchNormMeter
from cona.strategy import Strategy

sys.path.insert(0, str(LAUNCHED_DIR))  # as in the launched processes: the entry script's folder
from cona_gns_inject import MicroBatchGns  # noqa: E402
from cona_megatron_hooks import install  # noqa: E402


class TinyPipeGpt(nn.Module):
    """Parameter names like GPTModelPipe's: the tied embedding, a tp-sharded weight, a replicated norm."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tied_modules = nn.ModuleDict({"embed": nn.ModuleDict({"word_embeddings": nn.Embedding(11, 6)})})
        self.dense = nn.Linear(6, 6)
        self.dense.weight.tensor_model_parallel = True
        self.norm = nn.LayerNorm(6)

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        embedding = self.tied_modules["embed"]["word_embeddings"]
        hidden = self.norm(torch.tanh(self.dense(embedding(tokens))))
        logits = hidden @ embedding.weight.t()
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 11), tokens[:, 1:].reshape(-1))


def _micro_batches(count: int, seed: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 11, (2, 5), generator=generator) for _ in range(count)]


def _deepspeed_backward(model: TinyPipeGpt, batches: list[torch.Tensor]) -> None:
    for tokens in batches:
        (model.loss(tokens) / len(batches)).backward()


def _not_tied(model: nn.Module) -> list[nn.Parameter]:
    return [p for name, p in model.named_parameters() if not name.endswith("word_embeddings.weight")]


def test_sums_are_those_of_the_native_meter_and_of_the_mean_gradient():
    model = TinyPipeGpt()
    batches = _micro_batches(3)
    gns = MicroBatchGns(model.named_parameters(), tp=1)
    native = MicroBatchNormMeter(
        [model.dense, model.norm], ranks_per_copy=1, device=torch.device("cpu"), via_forward_hooks=False
    )
    gns.start_step(grad_factor=3.0, active=True)
    native.start_step(3.0)
    _deepspeed_backward(model, batches)
    small, big, small_batch, big_batch = gns.finish_step(micro_batches=3, dp=1, gbs=6)
    assert small == pytest.approx(float(native.total) / 3, rel=1e-6)
    mean_sqr = sum(float(p.grad.square().sum()) for p in _not_tied(model))
    assert big == pytest.approx(mean_sqr, rel=1e-6)
    assert (small_batch, big_batch) == (2, 6)


def test_a_tensor_parallel_shard_counts_once_a_replicated_tensor_one_tp_th():
    model = TinyPipeGpt()
    full = MicroBatchGns(model.named_parameters(), tp=1)
    halved = MicroBatchGns(model.named_parameters(), tp=2)
    for meter in (full, halved):
        meter.start_step(grad_factor=2.0, active=True)
    _deepspeed_backward(model, _micro_batches(2))
    sharded = sum(float(model.dense.weight.grad.square().sum()) for _ in [0])
    replicated = sum(float(p.grad.square().sum()) for p in _not_tied(model)) - sharded
    big_full = full.finish_step(micro_batches=2, dp=1, gbs=4)[1]
    big_halved = halved.finish_step(micro_batches=2, dp=1, gbs=4)[1]
    assert big_full == pytest.approx(sharded + replicated, rel=1e-6)
    assert big_halved == pytest.approx(sharded + replicated / 2, rel=1e-6)


def test_one_small_batch_per_step_pairs_consecutive_steps():
    model = TinyPipeGpt()
    gns = MicroBatchGns(model.named_parameters(), tp=1)
    grads = []
    for step, batch in enumerate(_micro_batches(2)):
        model.zero_grad()
        gns.start_step(grad_factor=1.0, active=True)
        _deepspeed_backward(model, [batch])
        grads.append([p.grad.clone() for p in _not_tied(model)])
        small, big, small_batch, big_batch = gns.finish_step(micro_batches=1, dp=1, gbs=2)
        assert (small_batch, big_batch) == (2, 4)
        if step == 0:
            assert math.isnan(small) and math.isnan(big)
    sqr = [sum(float(g.square().sum()) for g in step) for step in grads]
    pair = sum(float((a + b).square().sum()) for a, b in zip(*grads, strict=True))
    assert small == pytest.approx((sqr[0] + sqr[1]) / 2, rel=1e-6)
    assert big == pytest.approx(pair / 4, rel=1e-6)


def _data_parallel_rank(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        model = TinyPipeGpt()
        gns = MicroBatchGns(model.named_parameters(), tp=1)
        gns.start_step(grad_factor=2.0, active=True)
        _deepspeed_backward(model, _micro_batches(4)[2 * rank : 2 * rank + 2])
        results[rank] = gns.finish_step(micro_batches=2, dp=2, gbs=8, dp_group=None)
    finally:
        dist.destroy_process_group()


def test_two_data_parallel_ranks_give_the_sums_of_one_rank_with_all_micro_batches():
    from cona.runner.launch import pick_free_port

    results = mp.Manager().dict()
    mp.spawn(_data_parallel_rank, args=(pick_free_port(), results), nprocs=2, join=True)
    model = TinyPipeGpt()
    gns = MicroBatchGns(model.named_parameters(), tp=1)
    gns.start_step(grad_factor=4.0, active=True)
    _deepspeed_backward(model, _micro_batches(4))
    alone = gns.finish_step(micro_batches=4, dp=1, gbs=8)
    assert results[0] == pytest.approx(results[1])
    assert results[0] == pytest.approx(alone, rel=1e-5)


def _fake_training(model: TinyPipeGpt, micro_batches: int) -> SimpleNamespace:
    """The names of ``megatron.training`` the hooks use; train_step runs one DeepSpeed-like step."""
    args = SimpleNamespace(
        curr_iteration=0, log_interval=2, global_batch_size=2 * micro_batches, seq_length=5,
        consumed_train_samples=0, consumed_train_tokens=0, train_iters=100, train_tokens=None,
    )  # fmt: skip
    batches = iter(_micro_batches(20 * micro_batches))

    def train_step():
        model.zero_grad()
        _deepspeed_backward(model, [next(batches) for _ in range(micro_batches)])

    mpu = SimpleNamespace(
        get_tensor_model_parallel_world_size=lambda: 1,
        get_data_parallel_world_size=lambda: 1,
        get_data_parallel_group=lambda: None,
    )
    return SimpleNamespace(
        get_args=lambda: args, get_num_microbatches=lambda: micro_batches, mpu=mpu, is_last_rank=lambda: True,
        train_step=train_step, setup_model_and_optimizer=lambda: ([model], None, None),
    )  # fmt: skip


def _train(training: SimpleNamespace, steps: int) -> str:
    """Megatron's loop, reduced to what the hooks see; returns what the last rank printed."""
    args = training.get_args()
    printed = io.StringIO()
    with redirect_stdout(printed):
        training.setup_model_and_optimizer()
        iteration = 0
        while iteration < min(steps, args.train_iters):
            args.curr_iteration = iteration
            training.train_step()
            iteration += 1
            args.consumed_train_samples += args.global_batch_size
            args.consumed_train_tokens += args.global_batch_size * args.seq_length
            print(f" iteration {iteration:8d}/ {args.train_iters:7d} | consumed samples: "
                  f"{args.consumed_train_samples} | lm loss: 1.0E+01 |")  # fmt: skip
    return printed.getvalue()


def test_the_gns_line_fills_its_iteration_record_and_a_request_stops_the_loop(tmp_path):
    request = tmp_path / "switch_request.json"
    training = _fake_training(TinyPipeGpt(), micro_batches=2)
    step = training.train_step

    def requested_during_three():  # the search writes its request while step 3 trains
        step()
        if training.get_args().curr_iteration == 2:
            request.write_text("{}")

    training.train_step = requested_during_three
    hooks = install(training, {"CONA_MDS_SWITCH_REQUEST": str(request), "CONA_MDS_GNS_STEPS": "2"})
    output = _train(training, steps=10)
    records: list[dict] = []
    recorder = MetricsRecorder(stage=1, strategy=Strategy(dp=1, tp=1, pp=1, mbs=2, gbs=4), seq=5,
                               write=records.append, previous_iteration=0)  # fmt: skip
    for line in output.splitlines():
        recorder.feed(line)
    recorder.flush()
    assert [r["iteration"] for r in records] == [1, 2, 3]  # stopped after the step that saw the request
    assert records[0]["gns_small_sqr"] is None  # iteration 1 is not logged by the hooks (interval 2)
    logged = records[1]
    assert logged["gns_small_batch"] == 2 and logged["gns_big_batch"] == 4
    assert 0 < logged["gns_big_sqr"] < logged["gns_small_sqr"]
    assert hooks.meter is not None
    stop = recorder.stop
    assert stop is not None and (stop.iteration, stop.reason) == (3, "switch_requested")
    assert (stop.consumed_samples, stop.consumed_tokens) == (12, 60)


def test_the_stop_iteration_ends_the_loop_as_completed():
    training = _fake_training(TinyPipeGpt(), micro_batches=1)
    install(training, {"CONA_MDS_STOP_ITERATION": "4"})
    output = _train(training, steps=10)
    assert "cona stop | iteration 4 | consumed samples: 8 | consumed tokens: 40 | reason: completed" in output
    assert training.get_args().train_iters == 4
