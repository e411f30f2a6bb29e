"""CUDA graphs (``training.cuda_graphs``) compute the same steps as the plain compiled model (GPU only).

Both engines start from the same weights and train on the same batches; the graphs must give the same
losses, gradient norms, gradient-noise inputs and eval losses, replay at all (no skipped graph), and draw a
new dropout mask on every step (a mask baked into the graph would repeat). Skipped without CUDA; run on a
GPU machine with ``python -m pytest tests/engine/test_cuda_graphs.py``.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist
from tests.helpers.tiny import recorded_stances
from tests.helpers.torchrun_util import free_port

from cona.config import ConaConfig, ModelConfig, TrainingConfig
from cona.engine.optim import build_optimizer
from cona.engine.parallel_dims import build_mesh
from cona.engine.train_model import TrainingModel, build_training_model, uses_cuda_graphs
from cona.strategy import Strategy

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")

VOCAB, SEQ, MBS = 512, 128, 4


@pytest.fixture(scope="module")
def one_gpu_group():
    created = not dist.is_initialized()
    if created:
        torch.cuda.set_device(0)
        dist.init_process_group(
            "nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
            device_id=torch.device("cuda", 0),
        )  # fmt: skip
    yield
    if created:
        dist.destroy_process_group()


def config(*, cuda_graphs: bool, dropout: float = 0.0) -> ConaConfig:
    return ConaConfig(
        model=ModelConfig(
            layers=2, hidden=128, heads=4, seq=SEQ, vocab_size=VOCAB,
            attention_dropout=dropout, hidden_dropout=dropout,
        ),
        training=TrainingConfig(device="cuda", dtype="bf16", seed=5, compile=True, cuda_graphs=cuda_graphs),
    )  # fmt: skip


def engine(cfg: ConaConfig, gbs: int = MBS) -> TrainingModel:
    torch._dynamo.reset()
    strategy = Strategy(dp=1, tp=1, pp=1, mbs=MBS, gbs=gbs)
    return build_training_model(cfg, strategy, build_mesh(strategy, "cuda"), torch.device("cuda", 0))


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def train(model: TrainingModel, cfg: ConaConfig, steps: int) -> list[tuple[float, ...]]:
    optimizer = build_optimizer(model.model_parts, cfg.training)
    rows = []
    for step in range(steps):
        # Two of every three steps measure (1, 2, 4, 5), each as two halves: under graphs each half replays
        # a graph of its own shape, and the first half's gradients are held apart from the second's replay.
        out = model.train_step_pending([batch(step)], iteration=step + 1, measure_gns=step % 3 != 0).result()
        norm = model.clip_grad_norm_pending(cfg.training.optimizer.clip_grad).item()
        bool(model.optimizer_step_pending(optimizer).item())
        rows.append((out.loss, norm, out.gns_small_sqr, out.gns_big_sqr))
    rows.append((model.eval_loss([batch(100), batch(101)]),))
    return rows


@gpu
def test_graphs_train_the_same_steps_as_the_compiled_model(one_gpu_group, monkeypatch) -> None:
    stances = recorded_stances(monkeypatch)
    torch._dynamo.utils.counters.clear()
    with_graphs = engine(config(cuda_graphs=True))
    assert with_graphs.cuda_graphs
    graph_rows = train(with_graphs, config(cuda_graphs=True), steps=6)
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # the halves compiled nothing new
    assert "force_eager" not in stances[:-1]  # only the evaluation (the last) ran eager, not the halves
    del with_graphs
    plain = engine(config(cuda_graphs=False))
    assert not plain.cuda_graphs
    plain_rows = train(plain, config(cuda_graphs=False), steps=6)
    # Both measure at the same parameters, from the halves of a step (the steps 1 and 4 are not measured).
    measured = [False, True, True, False, True, True]
    assert [math.isfinite(row[2]) for row in plain_rows[:6]] == measured
    assert [math.isfinite(row[2]) for row in graph_rows[:6]] == measured
    for got, want in zip(graph_rows, plain_rows, strict=True):
        # the same losses, gradient norms and noise inputs: the graphs' halves sum to the step's gradient
        assert got == pytest.approx(want, rel=2e-3, nan_ok=True)


@gpu
def test_dropout_draws_a_new_mask_on_every_replay(one_gpu_group) -> None:
    cfg = config(cuda_graphs=True, dropout=0.3)
    model = engine(cfg)
    same = batch(7)
    losses = [model.train_step_pending([same], iteration=i).result().loss for i in (1, 2, 3, 1)]
    assert len(set(losses[:3])) == 3  # a new mask per iteration
    assert losses[3] == losses[0]  # seeded by the iteration: the same mask again


def test_graphs_only_where_a_step_is_one_whole_model_forward_and_backward() -> None:
    cfg, gpu0 = config(cuda_graphs=True), torch.device("cuda", 0)
    training, model = cfg.training, cfg.model
    strategy = Strategy(dp=1, tp=1, pp=1, mbs=MBS, gbs=2 * MBS)  # accumulation: two backward per step
    assert not uses_cuda_graphs(training, model, strategy, gpu0)
    one = dataclasses.replace(strategy, gbs=MBS)
    assert uses_cuda_graphs(training, model, one, gpu0)
    assert not uses_cuda_graphs(training, model, one, torch.device("cpu"))
    assert not uses_cuda_graphs(training.replace(compile=False), model, one, gpu0)
    assert not uses_cuda_graphs(training.replace(cuda_graphs=False), model, one, gpu0)
    assert not uses_cuda_graphs(training, model, dataclasses.replace(one, tp=2), gpu0)


@gpu
def test_an_in_place_switch_of_mbs_compiles_no_new_graph(one_gpu_group) -> None:
    """Batch rows x hidden x seq cross inductor's 5 Mi-element mix-order-reduction threshold between mbs 32
    and 64 (hidden 256, seq 512): the size test there used to guard the batch and recompile at mbs 64."""
    cfg = config(cuda_graphs=True)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hidden=256, seq=512))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    strategy = Strategy(dp=1, tp=1, pp=1, mbs=32, gbs=32)
    model = build_training_model(cfg, strategy, build_mesh(strategy, "cuda"), torch.device("cuda", 0))
    graphs = []
    for mbs in (32, 64, 48):
        if mbs != model.strategy.mbs:
            model.rebatch(Strategy(dp=1, tp=1, pp=1, mbs=mbs, gbs=mbs))
        tokens = torch.randint(0, VOCAB, (mbs, 513), generator=torch.Generator().manual_seed(mbs))
        for step in range(2):
            pending = model.train_step_pending([(tokens[:, :-1], tokens[:, 1:])], iteration=step + 1)
            assert math.isfinite(pending.result().loss)
        graphs.append(int(torch._dynamo.utils.counters["stats"]["unique_graphs"]))
    assert graphs == [graphs[0]] * 3
