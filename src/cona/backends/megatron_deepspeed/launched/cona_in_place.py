"""An in-place gbs switch inside the running Megatron-DeepSpeed processes (runs in the checkout's Python).

Megatron changes the global batch in process by itself (``--rampup-batch-size``): at the top of every
iteration ``megatron.training.train`` asks the micro-batch calculator (``megatron.global_vars``) for the
number of micro-batches and tells DeepSpeed (``model[0].set_train_batch_size``, which the pipeline engine
turns into its ``micro_batches``). A switch that keeps dp, tp, pp and mbs therefore needs no new process:

- the calculator is replaced by a :class:`megatron.microbatches.ConstantNumMicroBatches` of the new gbs and
  DeepSpeed is told at once (Megatron tells it again at every later iteration, from that calculator);
- the data stays as it is: Megatron's ``MegatronPretrainingSampler`` hands out micro-batches of ``mbs * dp``
  consecutive samples from ``consumed_train_samples`` on, whatever the gbs, so the samples and their order
  are those of a relaunch that builds the sampler at the same ``consumed_train_samples``;
- the LR scheduler (token based, as CONA runs it) takes the new peak and minimum LR, as
  ``--override-opt_param-scheduler`` gives them to a relaunched stage, and sets the param groups' LR at
  once (``step(0)`` at the tokens it last stepped at): Megatron steps its scheduler after each optimizer
  step (the LR of step k is set at the end of step k - 1), so without it the first step after the switch
  would train at the old rule's LR. A relaunch does the same after its checkpoint load (the hooks'
  ``after_setup``), where DeepSpeed restores the old stage's LR with the optimizer state; both then train
  the new stage's first step at the new rule;
- ``args`` get what a relaunch's command line and ``update_train_iters`` would give them (gbs, LR,
  ``train_iters = train_samples // gbs``, the stage's ``--train-tokens``), so a later save records them.

An mbs change is not done here: DeepSpeed's ``set_train_batch_size`` keeps the micro-batch size, and the
sampler and the pipeline's buffers are built for one micro-batch size.

The runner's command for the stage that continues after iteration N is ``<dir>/continue-<N>.json``
(:func:`command_path`), written atomically: ``{"stage", "gbs", "mbs", "lr", "min_lr", "warmup_tokens",
"decay_tokens", "train_tokens", "stop_iteration", "hand_over_at_stop"}``.
"""

from __future__ import annotations

import json
import os
import time

HANDOVER_DIR_ENV = "CONA_MDS_HANDOVER_DIR"
"""Where the runner writes its continue commands; unset: every switch goes through a checkpoint."""
HAND_OVER_AT_STOP_ENV = "CONA_MDS_HAND_OVER_AT_STOP"
"""``1``: at the stop iteration, hand over in place instead of leaving the loop (a chain step whose next
step switches in place)."""
RUNNER_PID_ENV = "CONA_MDS_RUNNER_PID"
"""The runner's pid: a process waiting for a continue command exits once the runner is gone."""
POLL_S = 0.05


def command_path(directory: str, iteration: int) -> str:
    return os.path.join(directory, f"continue-{iteration}.json")


def wait_for_command(path: str, *, runner_pid: int, poll_s: float = POLL_S) -> dict | None:
    """The runner's command once ``path`` appears; None as soon as the runner (or this process's parent,
    the launcher) is gone, so a killed runner leaves no process waiting for ever."""
    parent = os.getppid()
    while True:
        try:
            with open(path) as handle:
                return json.load(handle)
        except FileNotFoundError:
            pass
        if os.getppid() != parent or not _running(runner_pid):
            return None
        time.sleep(poll_s)


def _running(pid: int) -> bool:
    if pid <= 0:
        return True  # no runner named: wait for the command alone
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def keep_loop_running(args, iteration: int) -> None:
    """Let Megatron's loop reach the next ``train_step`` after ``iteration`` (the continue command then
    sets the next stage's own limits)."""
    args.train_tokens = None
    args.train_iters = max(args.train_iters, iteration + 1)


def switch_batch(command: dict, *, args, engine, scheduler, global_vars, calculator_class) -> None:
    """Apply a continue command between two iterations: the new gbs to Megatron's calculator and to
    DeepSpeed, the new LR to the scheduler, the stage's limits to ``args``. ``global_vars`` is
    ``megatron.global_vars``, ``calculator_class`` ``megatron.microbatches.ConstantNumMicroBatches``."""
    gbs, mbs, dp = int(command["gbs"]), int(command["mbs"]), int(args.data_parallel_size)
    if mbs != args.micro_batch_size:
        raise SystemExit(
            f"cona in-place switch: mbs {args.micro_batch_size} -> {mbs} cannot change in process "
            "(DeepSpeed keeps its micro-batch size); this switch must go through a checkpoint"
        )
    if gbs % (mbs * dp):
        raise SystemExit(f"cona in-place switch: gbs={gbs} is not a multiple of mbs*dp={mbs * dp}")
    if not hasattr(global_vars, "_GLOBAL_NUM_MICROBATCHES_CALCULATOR"):
        raise SystemExit(
            "cona in-place switch: megatron/global_vars.py has no _GLOBAL_NUM_MICROBATCHES_CALCULATOR"
        )
    global_vars._GLOBAL_NUM_MICROBATCHES_CALCULATOR = calculator_class(gbs, mbs, dp)
    engine.set_train_batch_size(gbs)
    args.global_batch_size = gbs
    args.train_iters = args.train_samples // gbs  # as update_train_iters computes it in a relaunch
    args.train_tokens = command["train_tokens"]
    args.lr, args.min_lr = float(command["lr"]), float(command["min_lr"])
    args.lr_warmup_tokens, args.lr_decay_tokens = command["warmup_tokens"], command["decay_tokens"]
    scheduler.max_lr, scheduler.min_lr = args.lr, args.min_lr
    scheduler.lr_warmup_tokens, scheduler.lr_decay_tokens = args.lr_warmup_tokens, args.lr_decay_tokens
    apply_schedule_now(scheduler)


def apply_schedule_now(scheduler) -> None:
    """Set the param groups' LR to the scheduler's rule at the tokens it last stepped at (no step counted,
    as its own ``load_state_dict`` does): the next step trains at the LR the current stage's rule gives it
    under Megatron's convention, not at the one the previous stage's last step (or the optimizer state a
    relaunch loaded after the scheduler's) left in them."""
    scheduler.step(0, token_num=scheduler.num_tokens)


class EvaluationDraws:
    """The validation and test iterators Megatron evaluates on: its own until an in-place switch, then
    those a relaunch at the new gbs builds. Megatron sizes these two datasets by the gbs at its start
    (``build_train_valid_test_datasets``: ``eval_iters * global_batch_size`` samples per draw), so after a
    larger gbs its own would run out, and a relaunch's index over the new sizes may order them otherwise.
    The training iterator stays: its sampler already continues as a relaunch's would."""

    def __init__(self, build) -> None:
        self.build = build
        """``megatron.training.build_train_valid_test_data_iterators`` (Megatron's own)."""
        self.provider = None
        self.originals: tuple = ()
        self.replacements: tuple = ()

    def built(self, provider, iterators: tuple) -> tuple:
        """Megatron's first build (``pretrain`` keeps these iterators in its locals)."""
        self.provider, self.originals = provider, tuple(iterators)
        return iterators

    def rebuild(self) -> None:
        """After an in-place switch, with ``args`` as a relaunch's: every rank builds (collectives inside)."""
        _, valid, test = self.build(self.provider)
        self.replacements = (valid, test)

    def current(self, data_iterator):
        """The iterator to evaluate on instead of ``data_iterator`` (one of Megatron's originals)."""
        if self.replacements and data_iterator is not None:
            for original, replacement in zip(self.originals[1:], self.replacements, strict=True):
                if data_iterator is original:
                    return replacement
        return data_iterator
