"""One stage through Megatron-DeepSpeed: the chain runner's launcher and publisher for this backend.

:class:`MdsBackend` plugs into :func:`cona.runner.schedules.sequence.run_chain` (``launcher=backend.launch,
publisher=backend.publish``), so the run directory, ``runner_state.json``, plans, pruning and the switch-cost
lines
are the native backend's. Per stage it writes ``stages/<N>/ds_config.json``, ``command.txt`` and
``megatron.log``
(the launcher's whole output), appends the parsed records to the run's ``metrics.jsonl`` and writes
``stage_result.json``. A stage that loads a universal checkpoint is verified first (:mod:`.verify`): an
evaluation-only launch under the new layout (``stages/<N>/verify.log``); the verdict goes to
``stages/<N>/switch_check.json`` and into the stage result.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
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
from cona.backends.megatron_deepspeed.log_parse import MetricsRecorder
from cona.backends.megatron_deepspeed.nodes import LastRankView
from cona.backends.megatron_deepspeed.universal import publish
from cona.backends.megatron_deepspeed.verify import (
    SavedProbe,
    probe_record,
    probe_strategy,
    read_saved_probe,
    unmeasurable,
    verdict_line,
    verdict_of,
    write_saved_probe,
)
from cona.engine.checkpoint import layout_dir
from cona.engine.metrics import ConsoleSink, JsonlSink, MetricsLogger, MetricsSink
from cona.engine.optim import lr_schedule
from cona.engine.spec import StageResult, StageSpec
from cona.engine.switch_check import Verdict, write_verdict
from cona.engine.trainer import gns_steps_per_line
from cona.errors import LaunchError
from cona.runner.stage_run import StageLaunch, checkpoint_dtype
from cona.strategy import Strategy

MEGATRON_LOG = "megatron.log"
VERIFY_LOG = "verify.log"
# Lines of Megatron's start-up and exit that date the switch's parts (the first match of each counts).
TIMING_LINES = {
    "process_start": "using world size:",
    "load_done": "[after model, optimizer, and learning rate scheduler are built]",
    "setup_done": "done with setup ...",
    "first_step_done": "| consumed samples:",
    "train_done": "after training is done",
    "save_done": "successfully saved checkpoint at iteration",
    # Megatron evaluates its final draws after it saved (so this is not the native "probe_done", which
    # precedes
    # the save): the cost of the "before" side of switch verification is final_eval_done - save_done.
    "final_eval_done": "-sample draw from test set",
}
_ERROR_LINE = re.compile(r"(Error|Exception|error:)")


@dataclass(frozen=True, kw_only=True)
class LaunchOutput:
    returncode: int
    timings: dict[str, float]
    view: LastRankView
    """What the last rank printed (on another node: that node's launcher shared it)."""
    log: Path
    seconds: float


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
    out: Callable[[str], None] = print

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
        load = CheckpointLoad.from_path(spec.load_path) if spec.load_path is not None else None
        verdict = self._verify(launch, load) if load is not None and load.universal and self.verify else None
        writes = launch.topology.node_rank == 0  # the stage directory is shared across nodes
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
            self._write_result(launch, strategy, output, verdict)

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
        logger = self._logger(spec, quiet=launch.quiet or not metrics)
        recorder = MetricsRecorder(
            stage=spec.stage,
            strategy=strategy,
            seq=spec.config.model.seq,
            write=logger.write if metrics else _discard,
            previous_iteration=_start_iteration(spec),
        )
        try:
            env = self._hook_env(spec, training=not args.skip_train)
            returncode, timings, seconds = self._stream(command, env, log, recorder)
        finally:
            recorder.flush()
            logger.close()
        view = nodes.exchange_view(
            log, recorder, topology, succeeded=returncode == 0, stage=spec.stage,
            timeout_s=spec.config.training.distributed_timeout_minutes * 60.0,
        )  # fmt: skip
        return LaunchOutput(returncode=returncode, timings=timings, view=view, log=log, seconds=seconds)

    def _hook_env(self, spec: StageSpec, *, training: bool) -> dict[str, str]:
        """The launch's environment, with what CONA's hooks in the launched processes read
        (``launched/cona_megatron_hooks.py``): the checkout's script, how many steps before each log line
        measure the gradient-noise inputs (as the native engine), and, when training, the stop rules."""
        env = self.env.process_env(self.base_env, device_type=self.device_type)
        env["CONA_MDS_SCRIPT"] = str(self.env.repo / "pretrain_gpt.py")
        env["CONA_MDS_GNS_STEPS"] = str(gns_steps_per_line(spec.config.training.log_interval))
        for key in ("CONA_MDS_STOP_ITERATION", "CONA_MDS_SWITCH_REQUEST"):
            env.pop(key, None)
        if training and spec.target_iteration is not None:
            env["CONA_MDS_STOP_ITERATION"] = str(spec.target_iteration)
        if training and self.switch_requests:
            env["CONA_MDS_SWITCH_REQUEST"] = str(spec.switch_request_path)
        return env

    def _stream(
        self, command: list[str], env: dict[str, str], log: Path, recorder: MetricsRecorder
    ) -> tuple[int, dict, float]:
        timings: dict[str, float] = {"launch": time.time()}
        began = time.perf_counter()
        with open(log, "w", buffering=1) as handle:  # line-buffered: the log is readable while it runs
            process = subprocess.Popen(
                command,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                cwd=self.env.repo,
                env=env,
            )
            assert process.stdout is not None
            try:
                for line in process.stdout:
                    handle.write(line)
                    now = time.time()
                    for key, marker in TIMING_LINES.items():
                        if key not in timings and marker in line:
                            timings[key] = now
                    recorder.feed(line)
            finally:
                returncode = process.wait()
        return returncode, timings, time.perf_counter() - began

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
            raise LaunchError(f"stage {spec.stage}: the verification launch failed: {_failure(output)}")
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
            raise LaunchError(f"stage {spec.stage}: Megatron-DeepSpeed failed: {_failure(output)}")

    def _write_result(
        self, launch: StageLaunch, strategy: Strategy, output: LaunchOutput, verdict: Verdict | None
    ) -> None:
        spec = launch.spec
        dtype = checkpoint_dtype(spec.config.training, self.device_type)
        save_dir = layout_dir(spec.workdir, spec.config, strategy, dtype, run_name=spec.run_name)
        stop = output.view.stop
        reason = stop.reason if stop is not None else "completed"
        iteration = _saved_iteration(save_dir, spec, early=reason == "switch_requested")
        checkpoint = save_dir / f"global_step{iteration}"
        tokens = self._consumed_tokens(spec, output, iteration)
        eval_seconds = _span(output.timings, "save_done", "final_eval_done")
        record = probe_record(
            output.view.evaluations,
            config=spec.config,
            shape=self.shape,
            strategy=strategy,
            eval_iters=spec.resolved_eval_iters(),
            dtype=precision_of(spec.config.training, self.device_type),
            seconds=eval_seconds,
        )
        if record is not None:
            write_saved_probe(
                checkpoint, SavedProbe(record=record, gbs=strategy.gbs, eval_iters=spec.resolved_eval_iters())
            )
        StageResult(
            stage=spec.stage,
            reason=reason,
            last_iteration=iteration,
            consumed_samples=tokens // spec.config.model.seq,
            consumed_tokens=tokens,
            checkpoint=str(checkpoint),
            timings=output.timings,
            switch_check=verdict.to_dict() if verdict is not None else None,
        ).write(spec.result_path)

    def _consumed_tokens(self, spec: StageSpec, output: LaunchOutput, iteration: int) -> int:
        """The tokens consumed at the saved iteration: a chain's plan (checked against Megatron's count),
        else Megatron's own count (an online stage stops where the budget or a switch request stops it)."""
        last, stop = output.view.last, output.view.stop
        reported = last["consumed_tokens"] if last is not None and last["iteration"] == iteration else None
        if stop is not None and stop.iteration == iteration:
            reported = stop.consumed_tokens  # also where no log line fell on the stop
        if not self.shape.stop_tokens:
            if reported is None:
                raise LaunchError(
                    f"stage {spec.stage}: Megatron-DeepSpeed reported no consumed tokens at its last "
                    f"iteration {iteration} (no log line and no stop line of CONA's hooks); see {output.log}"
                )
            return int(reported)
        tokens = self.shape.stop_tokens[spec.stage - 1]
        if reported is not None and reported != tokens:
            raise LaunchError(
                f"stage {spec.stage}: Megatron reports {reported} tokens at iteration "
                f"{iteration}, CONA planned {tokens}; see {output.log}"
            )
        return tokens


def _discard(record: dict) -> None:
    """The verification launch evaluates only; it writes no metrics."""


def _start_iteration(spec: StageSpec) -> int:
    """The iteration the stage starts from: 0, or the global_step number of the checkpoint it loads."""
    if spec.load_path is None:
        return 0
    match = re.match(r"global_step(\d+)", Path(spec.load_path).name)
    return int(match.group(1)) if match else 0


def _saved_iteration(save_dir: Path, spec: StageSpec, *, early: bool = False) -> int:
    """The iteration of the checkpoint Megatron saved at the stage's end (its tracker file), checked against
    the stage's target (``early``: a switch request stopped it before, which only an online stage does)."""
    tracker = save_dir / "latest_checkpointed_iteration.txt"
    try:
        iteration = int(tracker.read_text().strip())
    except (FileNotFoundError, ValueError):
        raise LaunchError(
            f"stage {spec.stage}: Megatron-DeepSpeed saved no checkpoint ({tracker} missing)"
        ) from None
    too_far = spec.target_iteration is not None and iteration > spec.target_iteration
    if too_far or (spec.target_iteration is not None and iteration != spec.target_iteration and not early):
        raise LaunchError(
            f"stage {spec.stage}: Megatron-DeepSpeed stopped at iteration {iteration}, not at the stage's "
            f"target {spec.target_iteration} (see {spec.stage_dir / MEGATRON_LOG})"
        )
    return iteration


def _span(timings: dict[str, float], start: str, end: str) -> float:
    """Seconds from the ``start`` line to the ``end`` line (0 when either was not seen)."""
    began, finished = timings.get(start), timings.get(end)
    return finished - began if began is not None and finished is not None else 0.0


def _failure(output: LaunchOutput) -> str:
    """The launch's exit code and its last error line (the log has the rest)."""
    lines = output.log.read_text(errors="replace").splitlines() if output.log.is_file() else []
    errors = [line.strip() for line in lines if _ERROR_LINE.search(line)]
    detail = errors[-1] if errors else (lines[-1].strip() if lines else "no output")
    return f"exit {output.returncode}: {detail[:300]} (log {output.log})"
