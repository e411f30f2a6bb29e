"""What CONA adds to an unmodified Megatron-DeepSpeed training process (runs in the checkout's interpreter).

:func:`install` wraps two functions of ``megatron.training`` that ``pretrain`` looks up by name at call time,
so the checkout's files stay untouched:

- ``setup_model_and_optimizer``: once the model is built, the gradient-noise hooks go on its parameters
  (:class:`cona_gns_inject.MicroBatchGns`).
- ``train_step``: the steps just before each log line measure the gradient-noise inputs (how many: env
  ``CONA_MDS_GNS_STEPS``, the native engine's count); at each logged iteration the last rank prints one
  ``cona gns | iteration N | small sqr: .. | big sqr: .. | small batch: .. | big batch: .. | measured
  steps: ..`` line (the means over the measured steps), which CONA's log parser puts into that iteration's
  record. After every step it also checks the stop rules, the same on every rank: the iteration in env
  ``CONA_MDS_STOP_ITERATION`` was reached, or the file in env ``CONA_MDS_SWITCH_REQUEST`` (the online
  search's request) exists on any rank (one all-reduce). Then it sets ``args.train_iters`` to the current
  iteration, so Megatron leaves its loop as at a planned end: it saves, then evaluates its final draws
  (the "before" loss of switch verification), and the last rank prints ``cona stop | iteration N |
  consumed samples: S | consumed tokens: T | reason: switch_requested`` (or ``completed``).

Megatron's own ``--kill-switch-file`` is not used: each rank checks it on its own, so two ranks can see the
file at different iterations, and it exits without the final evaluation.
"""

from __future__ import annotations

import math
import os

import torch
from cona_gns_inject import MicroBatchGns

SWITCH_REQUEST_ENV = "CONA_MDS_SWITCH_REQUEST"
STOP_ITERATION_ENV = "CONA_MDS_STOP_ITERATION"
GNS_STEPS_ENV = "CONA_MDS_GNS_STEPS"


class StepHooks:
    """The state of the wrapped functions in one process."""

    def __init__(self, training, env) -> None:
        self.training = training
        self.switch_request = env.get(SWITCH_REQUEST_ENV) or None
        self.stop_iteration = int(env[STOP_ITERATION_ENV]) if env.get(STOP_ITERATION_ENV) else None
        self.gns_steps = int(env.get(GNS_STEPS_ENV, "2"))
        self.meter: MicroBatchGns | None = None
        self.line_sums = [0.0, 0.0]
        self.line_batches: tuple[int, int] | None = None
        self.measured = 0

    def after_setup(self, model) -> None:
        mpu = self.training.mpu
        self.meter = MicroBatchGns(model[0].named_parameters(), tp=mpu.get_tensor_model_parallel_world_size())

    def train_step(self, original, *args, **kwargs):
        megatron_args = self.training.get_args()
        upcoming = megatron_args.curr_iteration + 1  # the iteration this step ends at
        log_interval = megatron_args.log_interval
        measure = self.meter is not None and (-upcoming) % log_interval < self.gns_steps
        micro_batches = self.training.get_num_microbatches()
        if self.meter is not None:
            self.meter.start_step(grad_factor=float(micro_batches), active=measure)
        output = original(*args, **kwargs)
        if measure:
            self._measured(micro_batches, megatron_args.global_batch_size)
        if upcoming % log_interval == 0:
            self._report(upcoming)
        reason = self._stop_reason(upcoming)
        if reason is not None:
            megatron_args.train_iters = upcoming  # Megatron leaves its loop, saves and evaluates
            # Megatron adds this step's samples only after train_step returns.
            samples = megatron_args.consumed_train_samples + megatron_args.global_batch_size
            tokens = (
                megatron_args.consumed_train_tokens
                + megatron_args.global_batch_size * megatron_args.seq_length
            )
            self._print(
                f"cona stop | iteration {upcoming} | consumed samples: {samples} | "
                f"consumed tokens: {tokens} | reason: {reason}"
            )
        return output

    def _measured(self, micro_batches: int, gbs: int) -> None:
        mpu = self.training.mpu
        small, big, small_batch, big_batch = self.meter.finish_step(
            micro_batches=micro_batches,
            dp=mpu.get_data_parallel_world_size(),
            gbs=gbs,
            dp_group=mpu.get_data_parallel_group(),
        )
        if math.isfinite(small) and math.isfinite(big):
            self.line_sums = [self.line_sums[0] + small, self.line_sums[1] + big]
            self.line_batches = (small_batch, big_batch)
            self.measured += 1

    def _report(self, iteration: int) -> None:
        if self.measured and self.line_batches is not None:
            small, big = (value / self.measured for value in self.line_sums)
            small_batch, big_batch = self.line_batches
            self._print(
                f"cona gns | iteration {iteration} | small sqr: {small:.9e} | big sqr: {big:.9e} | "
                f"small batch: {small_batch} | big batch: {big_batch} | measured steps: {self.measured}"
            )
        self.line_sums, self.line_batches, self.measured = [0.0, 0.0], None, 0

    def _stop_reason(self, iteration: int) -> str | None:
        requested = self.switch_request is not None and os.path.exists(self.switch_request)
        if self.switch_request is not None and torch.distributed.is_initialized():
            flag = torch.tensor([1.0 if requested else 0.0], device=self._device())
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            requested = bool(flag.item())
        if requested:
            return "switch_requested"
        if self.stop_iteration is not None and iteration >= self.stop_iteration:
            return "completed"
        return None

    def _device(self) -> torch.device:
        return self.meter.device if self.meter is not None else torch.device("cpu")

    def _print(self, line: str) -> None:
        """On the last rank, where Megatron prints its iteration lines (so the order is kept)."""
        if self.training.is_last_rank():
            print(line, flush=True)


def install(training, env=os.environ) -> StepHooks:
    """Wrap ``training.setup_model_and_optimizer`` and ``training.train_step`` (``megatron.training``)."""
    hooks = StepHooks(training, env)
    setup, step = training.setup_model_and_optimizer, training.train_step

    def setup_model_and_optimizer(*args, **kwargs):
        model, optimizer, scheduler = setup(*args, **kwargs)
        hooks.after_setup(model)
        return model, optimizer, scheduler

    def train_step(*args, **kwargs):
        return hooks.train_step(step, *args, **kwargs)

    training.setup_model_and_optimizer = setup_model_and_optimizer
    training.train_step = train_step
    return hooks
