"""One stage through Megatron-DeepSpeed: the stage driver's launcher and publisher for this backend.

:class:`MdsBackend` plugs into the driver (``launcher=backend, publisher=backend.publish``), so the run
directory, ``runner_state.json``, plans, pruning and the switch-cost lines are the native backend's. Per
stage it writes ``stages/<N>/ds_config.json``, ``command.txt`` and ``megatron.log`` (the launcher's whole
output), appends the parsed records to the run's ``metrics.jsonl`` and writes ``stage_result.json``
(:mod:`.stage_result`). A stage that loads a universal checkpoint is verified first (:mod:`.verify`): an
evaluation-only launch under the new layout (``stages/<N>/verify.log``); the verdict goes to
``stages/<N>/switch_check.json`` and into the stage result. On one node a stage whose next stage changes
only the gbs hands its processes over in place (:mod:`.handover`): the next stage sends them its gbs and LR
(``stages/<N>/continue.json``) and follows their output on; nothing is saved, converted or verified.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from cona.backends.megatron_deepspeed import nodes
from cona.backends.megatron_deepspeed.commands import (
    ChainShape,
    CheckpointLoad,
    StageArgs,
    check_supported,
    ds_config,
    launcher_command,
    precision_of,
    pretrain_args,
)
from cona.backends.megatron_deepspeed.environment import ENTRY_SCRIPT, MdsEnvironment
from cona.backends.megatron_deepspeed.handover import (
    IN_PLACE_MBS,
    Held,
    HeldLaunch,
    continue_command,
    fresh_handover_dir,
    handover_dir,
    send_command,
)
from cona.backends.megatron_deepspeed.launched.cona_in_place import (
    HAND_OVER_AT_STOP_ENV,
    HANDOVER_DIR_ENV,
    RUNNER_PID_ENV,
)
from cona.backends.megatron_deepspeed.log_parse import MetricsRecorder
from cona.backends.megatron_deepspeed.output import TIMING_LINES, LaunchOutput, failure_text, follow
from cona.backends.megatron_deepspeed.stage_result import MEGATRON_LOG, write_stage_result
from cona.backends.megatron_deepspeed.universal import publish
from cona.backends.megatron_deepspeed.verify import (
    probe_record,
    probe_strategy,
    read_saved_probe,
    unmeasurable,
    verdict_line,
    verdict_of,
)
from cona.engine.checkpoint.paths import layout_dir
from cona.engine.metrics import ConsoleSink, JsonlSink, MetricsLogger, MetricsSink
from cona.engine.optim import lr_schedule
from cona.engine.spec import StageSpec
from cona.engine.switch_check import Verdict, write_verdict
from cona.engine.trainer import gns_steps_per_line
from cona.errors import LaunchError
from cona.runner.run_lock import popen_holding_locks
from cona.runner.stage_run import StageLaunch, checkpoint_dtype
from cona.strategy import Strategy

VERIFY_LOG = "verify.log"
CONTINUE_RECORD = "continue.json"
"""In the directory of a stage that continued in place: the command its processes applied."""
IN_PLACE_ENV = (HANDOVER_DIR_ENV, RUNNER_PID_ENV, HAND_OVER_AT_STOP_ENV)


@dataclass(frozen=True, kw_only=True)
class MdsBackend:
    """Runs the stages of one run through a Megatron-DeepSpeed checkout."""

    env: MdsEnvironment
    shape: ChainShape
    device_type: str
    base_env: Mapping[str, str]
    repair: bool = True
    """Repair defect A after each conversion (off only in the tests that show the defect)."""
    verify: bool = True
    switch_requests: bool = False
    """Online mode: a stage stops early, saving, when the search writes its switch request."""
    in_place: bool = False
    """A stage whose next stage changes only the gbs hands its processes over to it (one node)."""
    out: Callable[[str], None] = print
    held: HeldLaunch = field(default_factory=HeldLaunch)
    """The launch a stage handed over, until the next stage continues it."""

    in_place_mbs = IN_PLACE_MBS

    @property
    def keeps_workers(self) -> bool:
        """The driver's question: can consecutive stages run in the same processes (see ``in_place``)?"""
        return self.in_place

    def __call__(self, launch: StageLaunch) -> None:
        self.launch(launch)

    def close(self) -> None:
        """Stop a launch still waiting for a stage that will not come (the run failed or was stopped)."""
        self.held.stop()

    def publish(self, global_step_dir: Path) -> Path:
        """The chain runner's publisher: ds_to_universal, repairs, ``latest_universal``."""
        publication = publish(self.env, global_step_dir, base_env=self.base_env, repair=self.repair)
        if publication.repaired:
            self.out(
                f"repaired the concatenation dimension of {len(publication.repaired)} row-parallel "
                f"parameters saved at tp=1 ({', '.join(publication.repaired)})"
            )
        return publication.universal

    def launch(self, launch: StageLaunch) -> None:
        """The chain runner's launcher: verify the loaded checkpoint, train, write the stage result."""
        spec = launch.spec
        strategy = spec.strategy
        check_supported(spec.config, strategy, self.device_type)
        writes = launch.topology.node_rank == 0  # the stage directory is shared across nodes
        if spec.continue_in_place:
            output, verdict = self._continue(launch), None
        else:
            self.held.stop()  # a launch no stage continued is not this stage's
            load = CheckpointLoad.from_path(spec.load_path) if spec.load_path is not None else None
            universal = load is not None and load.universal
            verdict = self._verify(launch, load) if universal and self.verify else None
            if verdict is not None:
                if writes:
                    write_verdict(spec.stage_dir, verdict)
                if not verdict.passed:
                    raise LaunchError(verdict_line(verdict))
            output = self._run(
                launch, strategy, self._stage_args(spec, strategy, load), MEGATRON_LOG, metrics=True
            )
        self._check_exit(output, spec)
        if writes:
            write_stage_result(
                launch, strategy, output, verdict, shape=self.shape, device_type=self.device_type
            )

    def _stage_args(
        self, spec: StageSpec, strategy: Strategy, load: CheckpointLoad | None, *, probe: bool = False
    ) -> StageArgs:
        dtype = checkpoint_dtype(spec.config.training, self.device_type)
        save_dir = layout_dir(spec.workdir, spec.config, strategy, dtype, run_name=spec.run_name)
        return StageArgs(
            ds_config_path=spec.stage_dir / ("verify_ds_config.json" if probe else "ds_config.json"),
            stop_tokens=None if probe else self.shape.stage_stop_tokens(spec.stage, spec.max_tokens),
            save_dir=None if probe else save_dir,
            load=load,
            schedule=lr_schedule(
                spec.config.training,
                planned_tokens=spec.planned_tokens,
                lr_factor=spec.lr_factor,
                min_lr_factor=spec.min_lr_factor,
            ),
            override_scheduler=load is not None,
            device_type=self.device_type,
            run_name=spec.run_name,
            skip_train=probe,
            eval_iters=spec.resolved_eval_iters(),
        )

    def _run(
        self, launch: StageLaunch, strategy: Strategy, args: StageArgs, log_name: str, *, metrics: bool
    ) -> LaunchOutput:
        spec, topology = launch.spec, launch.topology
        spec.stage_dir.mkdir(parents=True, exist_ok=True)
        args = replace(args, ds_config_path=args.ds_config_path.with_name(
            nodes.node_file(args.ds_config_path.name, topology)))  # fmt: skip
        args.ds_config_path.write_text(
            json.dumps(ds_config(strategy, spec.config.training, self.device_type), indent=1) + "\n"
        )
        log = spec.stage_dir / nodes.node_file(log_name, topology)
        command = launcher_command(
            self.env.deepspeed_launcher,
            nodes.placement(spec.stage_dir, topology),
            ENTRY_SCRIPT,
            pretrain_args(spec.config, strategy, self.shape, args),
        )
        (log.parent / f"{log.stem}.command.txt").write_text(" ".join(command) + "\n")
        nodes.forget_view(log, topology)
        env = self._hook_env(launch, training=not args.skip_train)

        def start() -> subprocess.Popen:
            return popen_holding_locks(
                command,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                cwd=self.env.repo,
                env=env,
            )

        return self._follow_stage(launch, strategy, log, start, metrics=metrics)

    def _continue(self, launch: StageLaunch) -> LaunchOutput:
        """Hand the held launch the stage's gbs and LR and follow it on (a stage continuing in place)."""
        spec = launch.spec
        held = self.held.take(iteration=spec.start_iteration, strategy=spec.strategy, stage=spec.stage)
        args = self._stage_args(spec, spec.strategy, None)
        command = continue_command(
            stage=spec.stage,
            strategy=spec.strategy,
            schedule=args.schedule,
            train_tokens=args.stop_tokens,
            stop_iteration=spec.target_iteration,
            hand_over_at_stop=spec.hand_over_in_place,
        )
        spec.stage_dir.mkdir(parents=True, exist_ok=True)

        def start() -> subprocess.Popen:
            send_command(held, command, spec.stage_dir / CONTINUE_RECORD)
            return held.process

        return self._follow_stage(launch, spec.strategy, spec.stage_dir / MEGATRON_LOG, start, metrics=True)

    def _follow_stage(
        self,
        launch: StageLaunch,
        strategy: Strategy,
        log: Path,
        start: Callable[[], subprocess.Popen],
        *,
        metrics: bool,
    ) -> LaunchOutput:
        """Follow the stage's output from ``start()`` on until its launch exits or hands over."""
        spec, topology = launch.spec, launch.topology
        logger = self._logger(spec, quiet=launch.quiet or not metrics)
        recorder = MetricsRecorder(
            stage=spec.stage,
            strategy=strategy,
            seq=spec.config.model.seq,
            write=logger.write if metrics else _discard,
            previous_iteration=_start_iteration(spec),
        )
        timings: dict[str, float] = {"launch": time.time()}
        began = time.perf_counter()
        try:
            with open(log, "w", buffering=1) as handle:  # line-buffered: the log is readable while it runs
                process = start()
                try:
                    returncode, handover = follow(process, handle, recorder.feed, timings, TIMING_LINES)
                except BaseException:
                    process.kill()
                    process.wait()
                    raise
        finally:
            recorder.flush()
            logger.close()
        seconds = time.perf_counter() - began
        if handover is not None:
            directory = handover_dir(spec.run_dir)
            self.held.keep(Held(process=process, strategy=strategy, iteration=handover, directory=directory))
        view = nodes.exchange_view(
            log, recorder, topology, succeeded=returncode in (0, None), stage=spec.stage,
            timeout_s=spec.config.training.runtime.distributed_timeout_minutes * 60.0,
        )  # fmt: skip
        return LaunchOutput(
            returncode=returncode or 0,
            handed_over=handover is not None,
            timings=timings,
            view=view,
            log=log,
            seconds=seconds,
        )

    def _hook_env(self, launch: StageLaunch, *, training: bool) -> dict[str, str]:
        """The launch's environment, with what CONA's hooks in the launched processes read
        (``launched/cona_megatron_hooks.py``): the checkout's script, how many steps before each log line
        measure the gradient-noise inputs (as the native engine), and, when training, the stop rules and
        (in place, on one node) where the continue commands come."""
        spec = launch.spec
        env = self.env.process_env(self.base_env, device_type=self.device_type)
        env["CONA_MDS_SCRIPT"] = str(self.env.repo / "pretrain_gpt.py")
        env["CONA_MDS_GNS_STEPS"] = str(gns_steps_per_line(spec.config.training.logging.log_interval))
        for key in ("CONA_MDS_STOP_ITERATION", "CONA_MDS_SWITCH_REQUEST", *IN_PLACE_ENV):
            env.pop(key, None)
        if training and spec.target_iteration is not None:
            env["CONA_MDS_STOP_ITERATION"] = str(spec.target_iteration)
        if training and self.switch_requests:
            env["CONA_MDS_SWITCH_REQUEST"] = str(spec.switch_request_path)
        may_hand_over = self.switch_requests or spec.hand_over_in_place
        if training and self.in_place and may_hand_over and launch.topology.nnodes == 1:
            env[HANDOVER_DIR_ENV] = str(fresh_handover_dir(spec.run_dir))
            env[RUNNER_PID_ENV] = str(os.getpid())
            if spec.hand_over_in_place:
                env[HAND_OVER_AT_STOP_ENV] = "1"
        return env

    def _logger(self, spec: StageSpec, *, quiet: bool) -> MetricsLogger:
        # Megatron writes TensorBoard and W&B itself (flags from the config); CONA adds metrics.jsonl +
        # console.
        sinks: list[MetricsSink] = [JsonlSink(spec.metrics_path)]
        if not quiet:
            sinks.append(ConsoleSink(sys.stdout))
        return MetricsLogger(sinks)

    def _verify(self, launch: StageLaunch, load: CheckpointLoad) -> Verdict:
        """Evaluate the saved draw under the new layout and compare it with the loss recorded before the
        save."""
        spec = launch.spec
        universal = load.directory / load.tag
        saved = read_saved_probe(universal)
        if saved is None:
            return unmeasurable(
                None, str(universal), "the checkpoint records no evaluation draw before its save"
            )
        strategy = probe_strategy(saved, spec.strategy)
        if strategy is None:
            why = f"dp={spec.strategy.dp} does not divide the saved draw's gbs {saved.gbs}"
            return unmeasurable(saved, str(universal), why)
        args = self._stage_args(spec, strategy, load, probe=True)
        output = self._run(
            launch, strategy, replace(args, eval_iters=saved.eval_iters), VERIFY_LOG, metrics=False
        )
        if output.returncode != 0:
            raise LaunchError(f"stage {spec.stage}: the verification launch failed: {failure_text(output)}")
        loaded = probe_record(
            output.view.evaluations,
            config=spec.config,
            shape=self.shape,
            strategy=strategy,
            eval_iters=saved.eval_iters,
            dtype=precision_of(spec.config.training, self.device_type),
            seconds=output.seconds,
        )
        # The verdict itself is reported by the chain runner (switch_check_line, or the refusal).
        self.out(f"stage {spec.stage}: verification launch under the new layout took {output.seconds:.1f} s")
        return verdict_of(saved, loaded, checkpoint=str(universal))

    def _check_exit(self, output: LaunchOutput, spec: StageSpec) -> None:
        if output.returncode != 0:
            raise LaunchError(f"stage {spec.stage}: Megatron-DeepSpeed failed: {failure_text(output)}")


def _discard(record: dict) -> None:
    """The verification launch evaluates only; it writes no metrics."""


def _start_iteration(spec: StageSpec) -> int:
    """The iteration the stage starts from: 0, or the global_step number of the checkpoint it loads."""
    if spec.continue_in_place:
        return spec.start_iteration or 0
    if spec.load_path is None:
        return 0
    match = re.match(r"global_step(\d+)", Path(spec.load_path).name)
    return int(match.group(1)) if match else 0
