"""AdamW parameter groups and the token-based LR schedule, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from cona.config import TrainingConfig
from cona.engine.optim import (
    LRSchedule,
    build_optimizer,
    initialise_state,
    lr_schedule,
    set_lr,
    uses_weight_decay,
)
from cona.errors import ConfigError


class TinyBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.norm = nn.LayerNorm(4)
        self.proj = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied: must appear once in the optimizer


def test_schedule_hand_computed_points() -> None:
    schedule = LRSchedule(peak_lr=1e-3, min_lr=1e-4, warmup_tokens=100, decay_tokens=1100)
    assert schedule.lr_at(0) == 0.0
    assert schedule.lr_at(25) == pytest.approx(2.5e-4)
    assert schedule.lr_at(100) == pytest.approx(1e-3)
    # Half-way through the cosine (600 = 100 + 1000/2): min + (peak - min) / 2.
    assert schedule.lr_at(600) == pytest.approx(5.5e-4)
    # A quarter: min + (peak - min) * (1 + cos(pi/4)) / 2 = 1e-4 + 9e-4 * 0.853553...
    assert schedule.lr_at(350) == pytest.approx(1e-4 + 9e-4 * 0.8535533905932737)
    assert schedule.lr_at(1100) == pytest.approx(1e-4)
    assert schedule.lr_at(10**9) == pytest.approx(1e-4)


def test_schedule_is_a_function_of_tokens_not_steps() -> None:
    """Two runs with different global batches see the same LR at the same token count."""
    schedule = LRSchedule(peak_lr=3e-4, min_lr=3e-5, warmup_tokens=4096, decay_tokens=65536)
    seq = 128
    small_steps = [schedule.lr_at(step * 8 * seq) for step in range(0, 64, 4)]  # gbs 8, every 4th step
    big_steps = [schedule.lr_at(step * 32 * seq) for step in range(16)]  # gbs 32, every step
    assert small_steps == big_steps


def test_schedule_is_monotone_after_warmup() -> None:
    schedule = LRSchedule(peak_lr=1.0, min_lr=0.1, warmup_tokens=10, decay_tokens=1000)
    values = [schedule.lr_at(t) for t in range(0, 1200, 7)]
    peak_index = max(range(len(values)), key=values.__getitem__)
    assert all(a <= b for a, b in zip(values[:peak_index], values[1 : peak_index + 1], strict=True))
    assert all(a >= b for a, b in zip(values[peak_index:], values[peak_index + 1 :], strict=False))


def test_schedule_without_warmup_starts_at_peak() -> None:
    schedule = LRSchedule(peak_lr=2.0, min_lr=0.0, warmup_tokens=0, decay_tokens=0)
    assert schedule.lr_at(0) == 0.0  # decay over zero tokens: straight to min
    schedule = LRSchedule(peak_lr=2.0, min_lr=0.0, warmup_tokens=0, decay_tokens=10)
    assert schedule.lr_at(0) == 2.0


def test_schedule_rejects_inconsistent_values() -> None:
    with pytest.raises(ValueError, match="min_lr <= peak_lr"):
        LRSchedule(peak_lr=1e-4, min_lr=1e-3, warmup_tokens=0, decay_tokens=10)
    with pytest.raises(ValueError, match="warmup_tokens <= decay_tokens"):
        LRSchedule(peak_lr=1e-3, min_lr=0.0, warmup_tokens=20, decay_tokens=10)


def test_lr_schedule_from_config_uses_fraction_and_planned_tokens() -> None:
    training = TrainingConfig(base_lr=6e-4, base_min_lr=6e-5, lr_warmup_frac=0.01)
    schedule = lr_schedule(training, planned_tokens=1_000_000, lr_factor=2.0, min_lr_factor=0.5)
    assert schedule == LRSchedule(peak_lr=1.2e-3, min_lr=3e-5, warmup_tokens=10_000, decay_tokens=1_000_000)


def test_lr_schedule_explicit_tokens_override() -> None:
    training = TrainingConfig(lr_warmup_tokens=500, lr_decay_tokens=9000, lr_warmup_frac=0.5)
    schedule = lr_schedule(training, planned_tokens=1_000_000)
    assert (schedule.warmup_tokens, schedule.decay_tokens) == (500, 9000)
    assert (schedule.peak_lr, schedule.min_lr) == (training.lr.base_lr, training.lr.base_min_lr)


def test_lr_schedule_min_never_above_peak() -> None:
    training = TrainingConfig(base_lr=2e-4, base_min_lr=2e-5)
    schedule = lr_schedule(training, planned_tokens=1000, lr_factor=0.05, min_lr_factor=1.0)
    assert schedule.peak_lr == pytest.approx(1e-5)
    assert schedule.min_lr == schedule.peak_lr


def test_lr_schedule_decay_shorter_than_warmup_names_the_key() -> None:
    training = TrainingConfig(lr_warmup_tokens=5000, lr_decay_tokens=100)
    with pytest.raises(ConfigError, match=r"training\.lr_decay_tokens \(100\) is shorter than the warmup"):
        lr_schedule(training, planned_tokens=10_000)


def test_decay_groups_by_name_and_ndim() -> None:
    assert uses_weight_decay("layers.0.attention.wq.weight", torch.empty(4, 4))
    assert uses_weight_decay("tok_embeddings.weight", torch.empty(10, 4))
    assert not uses_weight_decay("layers.0.attention.wq.bias", torch.empty(4))
    assert not uses_weight_decay("norm.weight", torch.empty(4))
    assert not uses_weight_decay("odd.bias", torch.empty(4, 4))


def test_build_optimizer_groups_and_hyperparameters() -> None:
    model = TinyBlock()
    training = TrainingConfig(weight_decay=0.05, adam_beta1=0.8, adam_beta2=0.9, adam_eps=1e-6)
    optimizer = build_optimizer([model], training)
    decay, no_decay = optimizer.param_groups
    assert {id(p) for p in decay["params"]} == {id(model.embed.weight), id(model.proj.weight)}
    assert {id(p) for p in no_decay["params"]} == {
        id(model.norm.weight),
        id(model.norm.bias),
        id(model.proj.bias),
    }
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.05, 0.0)
    assert decay["betas"] == (0.8, 0.9) and decay["eps"] == 1e-6
    # CPU tensors cannot use the fused kernel: foreach is chosen.
    assert decay["foreach"] is True and not decay["fused"]


def test_build_optimizer_over_several_parts_counts_shared_parameters_once() -> None:
    shared = nn.Linear(3, 3)
    first, second = nn.Sequential(shared, nn.Linear(3, 3)), nn.Sequential(shared)
    optimizer = build_optimizer([first, second], TrainingConfig())
    params = [p for group in optimizer.param_groups for p in group["params"]]
    assert len(params) == len({id(p) for p in params}) == 4


def test_set_lr_and_no_decay_group_really_skips_decay() -> None:
    model = nn.LayerNorm(3)
    optimizer = build_optimizer([model], TrainingConfig(weight_decay=0.5))
    set_lr(optimizer, 0.1)
    assert [g["lr"] for g in optimizer.param_groups] == [0.1]
    before = model.weight.detach().clone()
    model.weight.grad = torch.zeros(3)
    model.bias.grad = torch.zeros(3)
    optimizer.step()
    # Zero gradient and no decay: AdamW leaves the norm weight exactly as it was.
    assert torch.equal(model.weight, before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_on_cuda() -> None:
    model = nn.Linear(4, 4).cuda()
    optimizer = build_optimizer([model], TrainingConfig())
    assert optimizer.param_groups[0]["fused"] is True


def test_cosine_matches_closed_form_everywhere() -> None:
    schedule = LRSchedule(peak_lr=1.0, min_lr=0.25, warmup_tokens=50, decay_tokens=250)
    for tokens in range(50, 251, 10):
        expected = 0.25 + 0.75 * 0.5 * (1 + math.cos(math.pi * (tokens - 50) / 200))
        assert schedule.lr_at(tokens) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    ("amsgrad", "implementation"),
    [
        (False, "foreach"),
        (True, "foreach"),
        (False, "fused"),  # on CUDA where there is one; torch's fused AdamW also runs on a CPU
    ],
)
@pytest.mark.parametrize("default_dtype", [torch.float32, torch.float64])
def test_initialised_state_is_what_adams_first_step_creates(
    amsgrad: bool, implementation: str, default_dtype: torch.dtype
) -> None:
    """The state a checkpoint loads into: the same entries, shapes, dtypes and devices as AdamW's own lazy
    initialisation (here made by a step on zero gradients with lr 0, as DCP would), with step 0. Under a
    float64 default the step counter is float64, except fused AdamW's, which stays float32."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(default_dtype)  # what Adam and initialise_state both read
    try:
        _check_initialised_state(amsgrad, implementation)
    finally:
        torch.set_default_dtype(previous)


def _check_initialised_state(amsgrad: bool, implementation: str) -> None:
    device = "cuda" if implementation == "fused" and torch.cuda.is_available() else "cpu"
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3)).to(device)
    flags = {implementation: True, "amsgrad": amsgrad}
    ours = torch.optim.AdamW(model.parameters(), lr=1e-3, **flags)
    torchs = torch.optim.AdamW(model.parameters(), lr=0.0, **flags)
    initialise_state(ours)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    torchs.step()
    for param in model.parameters():
        mine, reference = ours.state[param], torchs.state[param]
        assert mine.keys() == reference.keys()
        for key, value in mine.items():
            want = reference[key]
            assert (value.shape, value.dtype, value.device) == (want.shape, want.dtype, want.device)
            if key != "step":
                assert torch.count_nonzero(value) == 0
        assert mine["step"].item() == 0.0 and reference["step"].item() == 1.0
    before = {id(value) for state in ours.state.values() for value in state.values()}
    initialise_state(ours)  # an optimizer with state keeps it
    assert before == {id(value) for state in ours.state.values() for value in state.values()}
