"""Gradient-noise inputs: a problem with known noise is recovered; the engine's fields on one process."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from tests.helpers.tiny import recorded_stances, tiny_config, tiny_engine
from torch import nn

from cona.config import ConaConfig
from cona.engine.gns import MicroBatchNormMeter, PreviousGradient, difference_estimate, is_tied
from cona.engine.model import GPT, init_weights
from cona.engine.step_noise import HeldPieceGradients, NoiseInputs, split_rows
from cona.engine.train_model import LossScaler, token_cross_entropy
from cona.planner.efficiency import NoiseScaleTracker
from cona.strategy import Strategy

DIM, NOISE_STD = 16, 1.0
LONG_MEMORY = 100_000
"""Tracker base batch: its EMA then remembers every measurement of these tests (a plain average)."""


class LinearRegression(nn.Module):
    """y = x . w* + noise; loss = mean squared error. At w = w* + delta, with x ~ N(0, I):
    G = 2 delta, tr(Sigma) = 4((d + 1)|delta|^2 + d sigma^2), so the noise scale tr(Sigma)/|G|^2 is known."""

    def __init__(self, generator: torch.Generator) -> None:
        super().__init__()
        self.w_star = torch.randn(DIM, generator=generator)
        delta = torch.randn(DIM, generator=generator)
        self.delta = delta / delta.norm()
        self.linear = nn.Linear(DIM, 1, bias=False)
        with torch.no_grad():
            self.linear.weight.copy_(self.w_star + self.delta)

    def true_noise_scale(self) -> float:
        delta_sqr = self.delta.square().sum().item()
        return ((DIM + 1) * delta_sqr + DIM * NOISE_STD**2) / delta_sqr

    def sample(self, rows: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(rows, DIM, generator=generator)
        return x, x @ self.w_star + NOISE_STD * torch.randn(rows, generator=generator)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (self.linear(x).squeeze(-1) - y).square().mean()


def test_micro_batch_norms_recover_a_planted_noise_scale() -> None:
    """The engine's accumulation path: loss/n per micro-batch, hooks scaled by n, big = accumulated grad."""
    generator = torch.Generator().manual_seed(0)
    problem = LinearRegression(generator)
    meter = MicroBatchNormMeter(
        [problem], ranks_per_copy=1, device=torch.device("cpu"), via_forward_hooks=False
    )
    n_micro, micro = 8, 32
    tracker = NoiseScaleTracker(base_batch=LONG_MEMORY)
    for _ in range(150):
        problem.zero_grad()
        meter.start_step(n_micro)
        for _ in range(n_micro):
            (problem.loss(*problem.sample(micro, generator)) / n_micro).backward()
        big = problem.linear.weight.grad.square().sum().item()
        tracker = tracker.update(
            small_sqr=meter.total.item() / n_micro, big_sqr=big, small_batch=micro, big_batch=n_micro * micro
        )
    assert tracker.noise_scale() == pytest.approx(problem.true_noise_scale(), rel=0.10)


def test_difference_estimator_recovers_a_planted_noise_scale() -> None:
    """One gradient per step (dp = 1, one micro-batch): consecutive gradients are the two small batches."""
    generator = torch.Generator().manual_seed(1)
    problem = LinearRegression(generator)
    batch = 64
    previous = PreviousGradient()
    weights = torch.ones(1)
    tracker = NoiseScaleTracker(base_batch=LONG_MEMORY)
    first = True
    for _ in range(800):
        problem.zero_grad()
        problem.loss(*problem.sample(batch, generator)).backward()
        grads = [problem.linear.weight.grad]
        sqr = grads[0].square().sum().item()
        pair = previous.sum_sqr(grads, weights).item()
        small, big, small_batch, big_batch = difference_estimate(previous.sqr, sqr, pair, batch)
        previous.hold([g.clone() for g in grads], sqr)
        if first:
            assert math.isnan(small) and math.isnan(big)  # nothing to pair the first gradient with
            first = False
        assert (small_batch, big_batch) == (batch, 2 * batch)
        tracker = tracker.update(small_sqr=small, big_sqr=big, small_batch=small_batch, big_batch=big_batch)
    assert tracker.noise_scale() == pytest.approx(problem.true_noise_scale(), rel=0.10)


def test_pair_norm_is_the_norm_of_the_sum_even_after_clipping() -> None:
    previous = PreviousGradient()
    a = [torch.tensor([1.0, 2.0]), torch.tensor([[3.0]])]
    b = [torch.tensor([0.5, -1.0]), torch.tensor([[1.0]])]
    weights = torch.tensor([1.0, 0.5])
    assert previous.sum_sqr(a, weights).item() == 0.0
    previous.hold(a, 14.0)
    torch._foreach_mul_(a, 0.25)  # the engine clips the held gradient in place
    previous.note_scaled(0.25)
    expected = (1.5**2 + 1.0**2) + 0.5 * 4.0**2
    assert previous.sum_sqr(b, weights).item() == pytest.approx(expected)
    assert difference_estimate(14.0, 2.25, expected, 4) == (8.125, expected / 4, 4, 8)


def test_held_copies_survive_the_gradients_being_overwritten() -> None:
    """Under CUDA graphs the next replay overwrites a step's gradients, and clipping scales only the live
    ones: the copy held must give the unclipped previous gradient, and forget() keeps its buffers."""
    previous = PreviousGradient(copies=True)
    a = [torch.tensor([1.0, 2.0]), torch.tensor([[3.0]])]
    b = [torch.tensor([0.5, -1.0]), torch.tensor([[1.0]])]
    weights = torch.tensor([1.0, 0.5])
    previous.hold(a, 14.0)
    buffers = previous.grads
    torch._foreach_mul_(a, 0.25)  # clipping the live gradients
    previous.note_scaled(0.25)
    torch._foreach_copy_(a, [torch.full_like(t, 99.0) for t in a])  # the replay reusing their memory
    expected = (1.5**2 + 1.0**2) + 0.5 * 4.0**2
    assert previous.sum_sqr(b, weights).item() == pytest.approx(expected)
    previous.forget()
    assert previous.grads is None and previous.sum_sqr(b, weights).item() == 0.0
    previous.hold(b, 2.25)
    assert all(held is buffer for held, buffer in zip(previous.grads, buffers, strict=True))
    assert torch.equal(previous.grads[0], b[0]) and previous.grads[0] is not b[0]


def test_held_pieces_add_up_to_the_step_gradient() -> None:
    """Under CUDA graphs each piece's replay overwrites the last one's gradients: what is held must be the sum
    of the earlier pieces even after their memory is reused, and it is added once to the last piece's."""
    params = [nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(1, 1))]
    pieces = [
        [torch.tensor([1.0, 2.0]), torch.tensor([[3.0]])],
        [torch.tensor([0.5, -1.0]), torch.tensor([[1.0]])],
    ]
    held = HeldPieceGradients()
    for step in range(2):  # the second step must start a fresh sum in the same buffers
        for grads in pieces:
            for param, grad in zip(params, grads, strict=True):
                param.grad = grad.clone()
            live = [param.grad for param in params]
            held.hold(params)
            assert all(param.grad is None for param in params)
            torch._foreach_copy_(live, [torch.full_like(t, 99.0) for t in live])  # the next replay
        for param, grad in zip(params, [torch.tensor([0.0, 1.0]), torch.tensor([[-2.0]])], strict=True):
            param.grad = grad.clone()
        held.add_to(params)
        assert params[0].grad.tolist() == [1.5, 2.0] and params[1].grad.tolist() == [[2.0]], step
    with pytest.raises(RuntimeError):
        held.add_to(params)


def test_compiled_measured_steps_run_their_halves_in_the_graph(one_process_group, monkeypatch) -> None:
    """The whole-model compile runs a measured step's halves in a static graph of their own shape (two graphs
    in all, no eager fallback) and gives the eager engine's losses, norms and noise inputs. The graphs are
    Dynamo's and AOT autograd's, compiled by the ``aot_eager`` backend: Inductor's C++ code generation, which
    takes minutes on the CPU, adds nothing to what the engine decides."""
    config = tiny_config()
    rows, stances = {}, recorded_stances(monkeypatch)
    compile_model = torch.compile
    monkeypatch.setattr(
        torch,
        "compile",
        lambda model, dynamic=None, options=None: compile_model(model, backend="aot_eager", dynamic=dynamic),
    )
    for compiled in (True, False):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        training = config.training.replace(compile=compiled)
        engine = tiny_engine(gbs=4, mbs=4, config=dataclasses.replace(config, training=training))
        rows[compiled] = []
        for step, (batch,) in enumerate(token_batches(config, 4, 4, seed=s) for s in range(4)):
            out = engine.train_step_pending([batch], measure_gns=step % 2 == 1).result()
            rows[compiled].append((out.loss, out.gns_small_sqr, out.gns_big_sqr))
            engine.drop_gradients()
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        assert graphs == (2 if compiled else 0)
    assert stances == []  # no step ran eager
    for got, want in zip(rows[True], rows[False], strict=True):
        assert got == pytest.approx(want, rel=1e-4, nan_ok=True)
    assert all(math.isfinite(row[1]) for row in rows[True][1::2])


def token_batches(
    config: ConaConfig, rows: int, mbs: int, seed: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    tokens = torch.randint(0, 64, (rows, config.model.seq + 1), generator=torch.Generator().manual_seed(seed))
    return list(zip(tokens[:, :-1].split(mbs), tokens[:, 1:].split(mbs), strict=True))


def plain_gns_sqr(config: ConaConfig, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[float, list]:
    """|grad|^2 (without the tied matrix) of the plain model's mean loss, and the gradients."""
    model = GPT(config.model)
    init_weights(model, config.model, config.training.runtime.seed)
    token_cross_entropy(model(inputs), targets).backward()
    grads = [(name, p.grad) for name, p in model.named_parameters() if not is_tied(name)]
    return sum(g.square().sum().item() for _, g in grads), grads


def test_engine_reports_micro_batch_norms_with_accumulation(one_process_group) -> None:
    engine = tiny_engine(gbs=4, mbs=2)
    config = engine.config
    batches = token_batches(config, 4, 2, seed=0)
    out = engine.train_step_pending(batches).result()
    per_micro = [plain_gns_sqr(config, *batch)[0] for batch in batches]
    big = plain_gns_sqr(config, *(torch.cat(parts) for parts in zip(*batches, strict=True)))[0]
    assert (out.gns_small_batch, out.gns_big_batch) == (2, 4)
    assert out.gns_small_sqr == pytest.approx(sum(per_micro) / 2, rel=1e-5)
    assert out.gns_big_sqr == pytest.approx(big, rel=1e-5)


def test_engine_pairs_consecutive_steps_with_one_sample(one_process_group) -> None:
    """mbs = 1 on one rank cannot be split: the difference estimator pairs two consecutive steps."""
    engine = tiny_engine(gbs=1, mbs=1)
    config = engine.config
    first_batch, second_batch = token_batches(config, 1, 1, seed=1)[0], token_batches(config, 1, 1, seed=2)[0]
    first = engine.train_step_pending([first_batch]).result()
    assert math.isnan(first.gns_small_sqr) and math.isnan(first.gns_big_sqr)
    engine.clip_grad_norm_pending(0.01).item()  # clipping the held gradient must not change the estimate
    second = engine.train_step_pending(
        [second_batch]
    ).result()  # no optimizer step: same parameters, two batches
    sqr_a, grads_a = plain_gns_sqr(config, *first_batch)
    sqr_b, grads_b = plain_gns_sqr(config, *second_batch)
    pair = sum(((a + b) / 2).square().sum().item() for (_, a), (_, b) in zip(grads_a, grads_b, strict=True))
    assert (second.gns_small_batch, second.gns_big_batch) == (1, 2)
    assert second.gns_small_sqr == pytest.approx((sqr_a + sqr_b) / 2, rel=1e-5)
    assert second.gns_big_sqr == pytest.approx(pair, rel=1e-5)


def test_a_measured_single_micro_batch_step_runs_as_halves(one_process_group) -> None:
    """gbs = mbs on one rank: the measured step accumulates two halves, so both norms are of this step's
    parameters; loss and gradient are those of the unsplit (unmeasured) step."""
    engine = tiny_engine(gbs=4, mbs=4)
    config = engine.config
    (batch,) = token_batches(config, 4, 4, seed=7)
    unsplit = engine.train_step_pending([batch], measure_gns=False).result()
    unsplit_grads = [p.grad.clone() for p in engine.model_parts[0].parameters()]
    split = engine.train_step_pending([batch]).result()
    assert split.loss == pytest.approx(unsplit.loss, rel=1e-6)
    for got, want in zip((p.grad for p in engine.model_parts[0].parameters()), unsplit_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    halves = [plain_gns_sqr(config, *half)[0] for half in split_rows(batch, 2)]
    assert (split.gns_small_batch, split.gns_big_batch) == (2, 4)
    assert split.gns_small_sqr == pytest.approx(sum(halves) / 2, rel=1e-5)
    assert split.gns_big_sqr == pytest.approx(plain_gns_sqr(config, *batch)[0], rel=1e-5)
    assert not engine._noise.meter._handles  # unmeasured steps run no hook
    odd = tiny_engine(gbs=3, mbs=3)  # odd mbs: thirds, one row each
    odd_config = odd.config
    assert odd.train_step_pending(token_batches(odd_config, 3, 3, seed=8)).result().gns_small_batch == 1


def test_halves_recover_a_planted_noise_scale_with_gbs_equal_to_mbs() -> None:
    """The engine's noise inputs on a problem with known noise, gbs = mbs = 64 and dp = 1: each measured step
    runs its micro-batch as two halves (loss / 2 each, as the engine scales it) at the same parameters."""
    generator = torch.Generator().manual_seed(2)
    problem = LinearRegression(generator)
    noise = NoiseInputs(
        [problem], strategy=Strategy(dp=1, tp=1, pp=1, mbs=64, gbs=64), tie_embeddings=False,
        is_first_stage=True, fsdp=False, device=torch.device("cpu"), copy_previous=False,
    )  # fmt: skip
    tracker = NoiseScaleTracker(base_batch=64)
    for _ in range(300):
        problem.zero_grad()
        pieces = noise.pieces_for(True)
        measure = noise.start_step(pieces, measure=True)
        for x, y in split_rows(problem.sample(64, generator), pieces):
            (problem.loss(x, y) / pieces).backward()
        sums, grads = noise.local_sums(pieces, measure)
        out = noise.output(torch.zeros(()), sums, grads, n_small=pieces, measure=measure, may_overflow=False)
        assert (out.gns_small_batch, out.gns_big_batch) == (32, 64)
        tracker = tracker.update(
            small_sqr=out.gns_small_sqr.item(), big_sqr=out.gns_big_sqr.item(), small_batch=32, big_batch=64
        )
    assert tracker.noise_scale() == pytest.approx(problem.true_noise_scale(), rel=0.10)


def test_clip_and_optimizer_step(one_process_group) -> None:
    engine = tiny_engine(gbs=4, mbs=2)
    config = engine.config
    batches = token_batches(config, 4, 2, seed=4)
    optimizer = torch.optim.SGD([p for part in engine.model_parts for p in part.parameters()], lr=0.5)
    first = engine.train_step_pending(batches).result()
    tied_sqr = engine.model_parts[0].tok_embeddings.weight.grad.square().sum().item()
    norm = engine.clip_grad_norm_pending(0.1).item()
    assert norm == pytest.approx(math.sqrt(first.gns_big_sqr + tied_sqr), rel=1e-5)
    assert norm > 0.1
    clipped = math.sqrt(sum(p.grad.square().sum().item() for p in engine.model_parts[0].parameters()))
    assert clipped == pytest.approx(0.1, rel=1e-4)
    assert bool(engine.optimizer_step_pending(optimizer).item()) is True
    assert all(p.grad is None for p in engine.model_parts[0].parameters())
    assert engine.train_step_pending(batches).result().loss < first.loss
    assert engine.eval_loss(batches) < first.loss


def test_loss_scaler_backs_off_and_grows() -> None:
    scaler = LossScaler(enabled=True, initial_scale=1024.0, growth_interval=2)
    scaler.update(found_inf=True)
    assert scaler.scale == 512.0
    scaler.update(found_inf=False)
    scaler.update(found_inf=False)
    assert scaler.scale == 1024.0
    disabled = LossScaler(enabled=False)
    disabled.update(found_inf=True)
    assert disabled.scale == 1.0


def test_fp16_loss_scaling_unscales_and_skips_overflow(one_process_group) -> None:
    """The scaler's path, driven on CPU: a scaled step equals the unscaled one; an overflow is skipped."""
    engine = tiny_engine(gbs=4, mbs=2)
    config = engine.config
    batches = token_batches(config, 4, 2, seed=5)
    reference = engine.train_step_pending(batches).result()
    reference_norm = engine.clip_grad_norm_pending(0.0).item()
    engine.scaler = LossScaler(enabled=True, initial_scale=1024.0)
    scaled = engine.train_step_pending(batches).result()
    assert scaled.loss == pytest.approx(reference.loss, rel=1e-6)
    assert scaled.gns_small_sqr == pytest.approx(reference.gns_small_sqr, rel=1e-5)
    assert engine.clip_grad_norm_pending(0.0).item() == pytest.approx(reference_norm, rel=1e-5)
    engine.scaler.scale = 3e38  # the scaled loss overflows fp32 like an fp16 one would
    params = [p.detach().clone() for p in engine.model_parts[0].parameters()]
    optimizer = torch.optim.SGD(engine.model_parts[0].parameters(), lr=0.1)
    engine.train_step_pending(batches).result()
    assert not math.isfinite(engine.clip_grad_norm_pending(1.0).item())
    assert bool(engine.optimizer_step_pending(optimizer).item()) is False
    assert engine.scaler.scale == 1.5e38
    assert all(torch.equal(p, q) for p, q in zip(params, engine.model_parts[0].parameters(), strict=True))


def test_gns_can_be_switched_off(one_process_group) -> None:
    engine = tiny_engine(gbs=4, mbs=2)
    config = engine.config
    batches = token_batches(config, 4, 2, seed=6)
    measured = engine.train_step_pending(batches).result()
    norm = engine.clip_grad_norm_pending(0.0).item()
    engine.disable_gns()
    off = engine.train_step_pending(batches).result()
    assert math.isnan(off.gns_small_sqr) and math.isnan(off.gns_big_sqr)
    assert off.loss == measured.loss and engine.clip_grad_norm_pending(0.0).item() == pytest.approx(
        norm, rel=1e-6
    )
