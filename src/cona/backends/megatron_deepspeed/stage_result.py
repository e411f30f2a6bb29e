"""``stage_result.json`` of one Megatron-DeepSpeed training launch (:mod:`.stage` runs the launch).

The result says where the stage stopped and why, and what it left: the checkpoint Megatron saved as it
left its loop (its tracker file names the iteration; the final evaluation of the saved state is written
beside it for the next stage's switch verification), or nothing when the stage handed its processes over
in place (:mod:`.handover`). The consumed tokens are a chain's plan, checked against Megatron's own count,
or Megatron's count.
"""

from __future__ import annotations

from pathlib import Path

from cona.backends.megatron_deepspeed.commands import ChainShape, precision_of
from cona.backends.megatron_deepspeed.output import LaunchOutput, span_s
from cona.backends.megatron_deepspeed.verify import SavedProbe, probe_record, write_saved_probe
from cona.engine.checkpoint.paths import layout_dir
from cona.engine.spec import StageResult, StageSpec
from cona.engine.switch_check import Verdict
from cona.errors import LaunchError
from cona.runner.stage_run import StageLaunch, checkpoint_dtype
from cona.strategy import Strategy

MEGATRON_LOG = "megatron.log"


def write_stage_result(
    launch: StageLaunch,
    strategy: Strategy,
    output: LaunchOutput,
    verdict: Verdict | None,
    *,
    shape: ChainShape,
    device_type: str,
) -> None:
    """``stage_result.json`` of a training launch: where it stopped and why, the checkpoint it saved (with
    its final evaluation beside it), or, when it handed over in place, none."""
    spec = launch.spec
    stop = output.view.stop
    reason = stop.reason if stop is not None else "completed"
    if output.handed_over:  # nothing saved: the next stage continues the processes' state
        assert stop is not None, "the hooks print their stop line before the hand-over line"
        iteration, checkpoint = stop.iteration, None
    else:
        dtype = checkpoint_dtype(spec.config.training, device_type)
        save_dir = layout_dir(spec.workdir, spec.config, strategy, dtype, run_name=spec.run_name)
        iteration = _saved_iteration(save_dir, spec, early=reason == "switch_requested")
        checkpoint = save_dir / f"global_step{iteration}"
        _save_probe(spec, strategy, output, checkpoint, shape=shape, device_type=device_type)
    tokens = _consumed_tokens(spec, output, iteration, shape)
    StageResult(
        stage=spec.stage,
        reason=reason,
        last_iteration=iteration,
        consumed_samples=tokens // spec.config.model.seq,
        consumed_tokens=tokens,
        checkpoint=str(checkpoint) if checkpoint is not None else None,
        timings=output.timings,
        switch_check=verdict.to_dict() if verdict is not None else None,
        handed_over=output.handed_over,
    ).write(spec.result_path)


def _save_probe(
    spec: StageSpec,
    strategy: Strategy,
    output: LaunchOutput,
    checkpoint: Path,
    *,
    shape: ChainShape,
    device_type: str,
) -> None:
    """The final evaluation of the saved state, beside the checkpoint (switch verification's "before")."""
    record = probe_record(
        output.view.evaluations,
        config=spec.config,
        shape=shape,
        strategy=strategy,
        eval_iters=spec.resolved_eval_iters(),
        dtype=precision_of(spec.config.training, device_type),
        seconds=span_s(output.timings, "save_done", "final_eval_done"),
    )
    if record is not None:
        write_saved_probe(
            checkpoint, SavedProbe(record=record, gbs=strategy.gbs, eval_iters=spec.resolved_eval_iters())
        )


def _consumed_tokens(spec: StageSpec, output: LaunchOutput, iteration: int, shape: ChainShape) -> int:
    """The tokens consumed at the saved iteration: a chain's plan (checked against Megatron's count),
    else Megatron's own count (an online stage stops where the budget or a switch request stops it)."""
    last, stop = output.view.last, output.view.stop
    reported = last["consumed_tokens"] if last is not None and last["iteration"] == iteration else None
    if stop is not None and stop.iteration == iteration:
        reported = stop.consumed_tokens  # also where no log line fell on the stop
    if not shape.stop_tokens:
        if reported is None:
            raise LaunchError(
                f"stage {spec.stage}: Megatron-DeepSpeed reported no consumed tokens at its last "
                f"iteration {iteration} (no log line and no stop line of CONA's hooks); see {output.log}"
            )
        return int(reported)
    tokens = shape.stop_tokens[spec.stage - 1]
    if reported is not None and reported != tokens:
        raise LaunchError(
            f"stage {spec.stage}: Megatron reports {reported} tokens at iteration "
            f"{iteration}, CONA planned {tokens}; see {output.log}"
        )
    return tokens


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
