"""Training steps of the whole model timed on this host's CPU, in the runner, before a CPU run's first stage.

The planner's prior for a CPU (``cpu_gloo``) is a rough description of one core; a small model's step on a
shared CPU is mostly per-operator overhead the description has no term for, so the prior's first guess can
miss by 10x or more. Two micro-batch sizes timed here, each a forward, backward and AdamW step of the run's
own model on one process with the threads a worker gets, give the fit two shapes of this host's step (its
fixed part and its part per sample) before anything is decided: :meth:`cona.runner.schedules.frontier.
FrontierSearch.fit_prior`.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cona.config import ModelConfig
from cona.engine.model import GPT

TIMED_STEPS = 3
"""Steps timed per micro-batch size (after the untimed warm-up steps)."""
WARMUP_STEPS = 2
"""Untimed steps first: the first calls of a shape allocate and pick kernels."""
SLOW_STEP_S = 1.0
"""A first step slower than this: one more step is timed, and no larger size (the probe stays within a few
steps of the model)."""


@dataclass(frozen=True, kw_only=True)
class HostStep:
    micro_batch: int
    """Sequences in the step."""
    seconds: float
    """The median timed step on one process (no other worker running)."""


def time_host_steps(model: ModelConfig, micro_batches: tuple[int, ...], *, threads: int) -> list[HostStep]:
    """The model's step at each micro-batch size on this process's CPU with ``threads`` threads (fp32,
    random tokens, dropout as configured)."""
    torch.manual_seed(0)
    net = GPT(model)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    steps = []
    try:
        for micro_batch in micro_batches:
            tokens = torch.randint(0, model.vocab_size, (micro_batch, model.seq))
            slow = _step(net, optimizer, tokens) > SLOW_STEP_S  # a large model: one more step, one size
            warmup, timed = (0, 1) if slow else (WARMUP_STEPS - 1, TIMED_STEPS)
            times = [_step(net, optimizer, tokens) for _ in range(warmup + timed)]
            steps.append(HostStep(micro_batch=micro_batch, seconds=statistics.median(times[warmup:])))
            if slow:
                break
    finally:
        torch.set_num_threads(previous)
    return steps


def _step(net: GPT, optimizer: torch.optim.Optimizer, tokens: torch.Tensor) -> float:
    started = time.perf_counter()
    logits = net(tokens)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - started
