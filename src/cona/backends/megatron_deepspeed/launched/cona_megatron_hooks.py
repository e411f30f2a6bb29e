"""What CONA adds to an unmodified Megatron-DeepSpeed training process (runs in the checkout's interpreter).

:func:`install` wraps functions of ``megatron.training`` that ``pretrain`` looks up by name at call time, so
the checkout's files stay untouched:

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

In place (env ``CONA_MDS_HANDOVER_DIR``, one node): a request with ``"in_place": true`` (or, with env
``CONA_MDS_HAND_OVER_AT_STOP=1``, the stop iteration) hands the stage over instead: the stop line says
``switch_in_place`` (``completed`` at the stop iteration), Megatron's loop is kept running, and at the top of
the next step the last rank prints ``cona handover | iteration N``, every rank waits for the runner's
continue command and applies it (:mod:`cona_in_place`: the new gbs and LR), and training goes on in the
same processes. A request that comes when the loop ends anyway goes through the checkpoint. Evaluations
then draw from the datasets a relaunch would build (``build_train_valid_test_data_iterators`` and
``evaluate_and_print_results`` are wrapped for that).

Megatron's own ``--kill-switch-file`` is not used: each rank checks it on its own, so two ranks can see the
file at different iterations, and it exits without the final evaluation.
"""

from __future__ import annotations

import json
import math
import os

import cona_in_place
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
        self.handover_dir = env.get(cona_in_place.HANDOVER_DIR_ENV) or None
        self.hand_over_at_stop = env.get(cona_in_place.HAND_OVER_AT_STOP_ENV) == "1"
        self.runner_pid = int(env.get(cona_in_place.RUNNER_PID_ENV) or 0)
        self.handover: int | None = None
        """The iteration a stage handed over at, until the next stage's continue command is applied."""
        self.meter: MicroBatchGns | None = None
        self.model = self.scheduler = None
        self.draws: cona_in_place.EvaluationDraws | None = None
        """With a hand-over directory: the evaluation iterators (rebuilt at each in-place switch)."""
        self.line_sums = [0.0, 0.0]
        self.line_batches: tuple[int, int] | None = None
        self.measured = 0

    def after_setup(self, model, scheduler) -> None:
        mpu = self.training.mpu
        self.model, self.scheduler = model, scheduler
        if scheduler is not None:  # a loaded checkpoint restored the previous stage's LR with its optimizer
            cona_in_place.apply_schedule_now(scheduler)
        self.meter = MicroBatchGns(model[0].named_parameters(), tp=mpu.get_tensor_model_parallel_world_size())

    def train_step(self, original, *args, **kwargs):
        megatron_args = self.training.get_args()
        if self.handover is not None:
            self._continue(megatron_args)
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
        # Megatron adds this step's samples only after train_step returns.
        gbs = megatron_args.global_batch_size
        samples = megatron_args.consumed_train_samples + gbs
        tokens = megatron_args.consumed_train_tokens + gbs * megatron_args.seq_length
        reason, in_place = self._stop_reason(upcoming, megatron_args, tokens)
        if reason is not None:
            if in_place:
                self.handover = upcoming
                cona_in_place.keep_loop_running(megatron_args, upcoming)
            else:
                megatron_args.train_iters = upcoming  # Megatron leaves its loop, saves and evaluates
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

    def _stop_reason(self, iteration: int, megatron_args, tokens: int) -> tuple[str | None, bool]:
        """Why the stage ends after ``iteration`` (None: it goes on), and whether it hands over in place:
        only where Megatron's loop would go on (not at the stop iteration or the ``--train-tokens``
        budget, unless the stop iteration itself hands over)."""
        requested = self._requested()
        at_stop = self.stop_iteration is not None and iteration >= self.stop_iteration
        budget = megatron_args.train_tokens
        loop_ends = at_stop or (budget is not None and tokens >= budget)
        if requested:
            in_place = requested == 2 and not loop_ends
            return ("switch_in_place" if in_place else "switch_requested"), in_place
        if at_stop:
            return "completed", self.handover_dir is not None and self.hand_over_at_stop
        return None, False

    def _requested(self) -> int:
        """0: no switch request on any rank, 1: one through a checkpoint, 2: one in place (agreed by one
        all-reduce; in place only where this process can hand over)."""
        code = 0
        if self.switch_request is not None and os.path.exists(self.switch_request):
            code = 2 if self.handover_dir is not None and _asks_in_place(self.switch_request) else 1
        if self.switch_request is not None and torch.distributed.is_initialized():
            flag = torch.tensor([float(code)], device=self._device())
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            code = int(flag.item())
        return code

    def _continue(self, megatron_args) -> None:
        """At the top of the step after a hand-over: say so, wait for the runner's continue command,
        apply it."""
        iteration, self.handover = self.handover, None
        self._print(f"cona handover | iteration {iteration}")
        path = cona_in_place.command_path(self.handover_dir, iteration)
        command = cona_in_place.wait_for_command(path, runner_pid=self.runner_pid)
        if command is None:
            print(f"cona: the runner is gone while waiting for {path}; exiting", flush=True)
            os._exit(1)
        global_vars, calculator_class = self.batch_modules()
        cona_in_place.switch_batch(
            command,
            args=megatron_args,
            engine=self.model[0],
            scheduler=self.scheduler,
            global_vars=global_vars,
            calculator_class=calculator_class,
        )
        if self.draws is not None:
            self.draws.rebuild()
        self.stop_iteration = command["stop_iteration"]
        self.hand_over_at_stop = bool(command["hand_over_at_stop"])
        # The new stage measures from scratch, as a relaunched process would.
        self.line_sums, self.line_batches, self.measured = [0.0, 0.0], None, 0
        if self.meter is not None:
            self.meter.start_step(1.0, active=False)

    @staticmethod
    def batch_modules():
        """``megatron.global_vars`` and ``megatron.microbatches.ConstantNumMicroBatches`` (what an in-place
        switch changes; the CPU tests give their own)."""
        import megatron.global_vars
        import megatron.microbatches

        return megatron.global_vars, megatron.microbatches.ConstantNumMicroBatches

    def _device(self) -> torch.device:
        return self.meter.device if self.meter is not None else torch.device("cpu")

    def _print(self, line: str) -> None:
        """On the last rank, where Megatron prints its iteration lines (so the order is kept)."""
        if self.training.is_last_rank():
            print(line, flush=True)


def _asks_in_place(request_path: str) -> bool:
    try:
        with open(request_path) as handle:
            return json.load(handle).get("in_place") is True
    except (OSError, ValueError):
        return False  # removed meanwhile (or not JSON): through the checkpoint, as any other request


def install(training, env=os.environ) -> StepHooks:
    """Wrap ``training.setup_model_and_optimizer`` and ``training.train_step`` (``megatron.training``)."""
    hooks = StepHooks(training, env)
    setup, step = training.setup_model_and_optimizer, training.train_step

    def setup_model_and_optimizer(*args, **kwargs):
        model, optimizer, scheduler = setup(*args, **kwargs)
        hooks.after_setup(model, scheduler)
        return model, optimizer, scheduler

    def train_step(*args, **kwargs):
        return hooks.train_step(step, *args, **kwargs)

    training.setup_model_and_optimizer = setup_model_and_optimizer
    training.train_step = train_step
    if hooks.handover_dir is not None:
        _install_evaluation_draws(training, hooks)
    return hooks


def _install_evaluation_draws(training, hooks: StepHooks) -> None:
    """Wrap ``build_train_valid_test_data_iterators`` (called once by ``pretrain``) and
    ``evaluate_and_print_results`` so that evaluations after an in-place switch draw from the datasets a
    relaunch builds (:class:`cona_in_place.EvaluationDraws`)."""
    draws = hooks.draws = cona_in_place.EvaluationDraws(training.build_train_valid_test_data_iterators)
    evaluate = training.evaluate_and_print_results

    def build_train_valid_test_data_iterators(provider):
        return draws.built(provider, draws.build(provider))

    def evaluate_and_print_results(prefix, forward_step_func, data_iterator, *args, **kwargs):
        return evaluate(prefix, forward_step_func, draws.current(data_iterator), *args, **kwargs)

    training.build_train_valid_test_data_iterators = build_train_valid_test_data_iterators
    training.evaluate_and_print_results = evaluate_and_print_results
