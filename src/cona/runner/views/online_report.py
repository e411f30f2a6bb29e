"""The end of an online run: the realised chain as a chain file, and the per-stage summary table."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from cona import run_files
from cona.engine.spec import StageResult
from cona.metrics_record import measured_tokens_per_s, read_metrics
from cona.runner.state import RunState
from cona.strategy import Strategy

STAGE_COLUMNS_CAPTION = (
    "wall s: the stage's launch to the end of its save (start-up and load included); "
    "tokens/s: the median of its steady log intervals"
)
"""What the summary's timing columns count (``cona report``'s stage table says the same)."""


def realized_chain(state: RunState, stages: list[dict[str, Any]]) -> dict[str, Any]:
    """A chain file that trains the same strategies to the same iterations (absolute ``train_iters``), so
    ``cona train --chain`` replays the run's strategies and consumed samples."""
    steps: list[dict[str, Any]] = []
    trained = [stage for stage in state.stages if stage.last_iteration is not None]
    for index, stage in enumerate(trained):
        strategy = Strategy(**stages[index]["strategy"])
        step: dict[str, Any] = {
            "step_num": stage.step_num,
            "dp": strategy.dp,
            "tp": strategy.tp,
            "pp": strategy.pp,
            "gbs": strategy.gbs,
            "mbs": strategy.mbs,
            "train_iters": stage.last_iteration,
        }
        if index == 0:
            step["is_initial"] = True
        else:
            previous = Strategy(**stages[index - 1]["strategy"])
            step.update(load_dp=previous.dp, load_tp=previous.tp, load_pp=previous.pp)
        step["convert"] = index < len(trained) - 1
        steps.append(step)
    return {"steps": steps}


def stage_rows(run_dir: Path, state: RunState, stages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per trained stage: strategy, iterations, tokens, wall seconds (:attr:`StageResult.wall_s`: its launch
    to the end of its save), its measured tokens/s (:func:`cona.metrics_record.measured_tokens_per_s`: the
    median of its steady log intervals), the tokens/s predicted when it was chosen, and the last eval
    perplexity."""
    records = read_metrics(run_files.metrics_path(run_dir))
    rows = []
    previous_iteration, previous_tokens = 0, 0
    for stage in state.stages:
        if stage.last_iteration is None:
            continue
        span = range(previous_iteration + 1, stage.last_iteration + 1)  # not a killed attempt's lines past it
        own = [r for r in records if r.stage == stage.step_num and (r.iteration or 0) in span]
        evals = [r.eval_ppl for r in own if r.eval_ppl is not None]
        result_path = run_files.stage_result_path(run_dir, stage.step_num)
        wall = StageResult.read(result_path).wall_s if result_path.is_file() else None
        rows.append(
            {
                "stage": stage.step_num,
                "strategy": Strategy(**stages[stage.step_num - 1]["strategy"]).short(),
                "iterations": stage.last_iteration - previous_iteration,
                "tokens": (stage.consumed_tokens or 0) - previous_tokens,
                "wall_s": wall,
                "tokens_per_s": measured_tokens_per_s(own),
                "predicted_tokens_per_s": stages[stage.step_num - 1].get("predicted_tokens_per_s"),
                "prediction_basis": prediction_basis(stages[stage.step_num - 1]),
                "eval_ppl": evals[-1] if evals else None,
                "action": stages[stage.step_num - 1]["action"],
            }
        )
        previous_iteration, previous_tokens = stage.last_iteration, stage.consumed_tokens or 0
    return rows


def prediction_basis(stage: dict[str, Any]) -> str:
    """What the tokens/s a stage was chosen on rested on: the rate its branch of a won probe measured, the
    rate it had measured before (a fall-back, a stage returned to; ``as before`` where it was never measured:
    the rate it was first chosen on), the model fitted on N measured strategies, the model fitted on the
    run's first line (its steps after the first, the strategy's own steps), or the raw model's prior where
    nothing was measured yet (the first stage: on a CPU, whose system file is a rough description, it can be
    off by 10x or more)."""
    if stage.get("throughput_source") in ("measured", "probed"):
        return stage["throughput_source"]
    if stage.get("action") == "fallback":  # back to a stage never measured: the rate it was chosen on
        return "as before"
    fitted_on = stage.get("fitted_on") or 0
    if fitted_on:
        return f"fit on {fitted_on}"
    return "first line" if stage.get("on_first_line") else "prior"


def time_to_target(run_dir: Path, target_ppl: float) -> tuple[float, int] | None:
    """Seconds from the first stage's launch to the first evaluation at or below ``target_ppl``, and the
    tokens consumed then (None when it was not reached)."""
    first = run_files.stage_result_path(run_dir, 1)
    if not first.is_file():
        return None
    start = StageResult.read(first).timings.get("launch")
    for record in read_metrics(run_files.metrics_path(run_dir)):
        ppl = record.eval_ppl
        if ppl is not None and ppl <= target_ppl and start is not None:
            return record.time - start, record.consumed_tokens
    return None


def print_summary(
    run_dir: Path,
    state: RunState,
    stages: list[dict[str, Any]],
    *,
    target_ppl: float | None,
    out: Callable[[str], None] = print,
) -> None:
    """The per-stage table (rich), then the time to --target-ppl when one was given."""
    from io import StringIO

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"online run {run_dir.name}", caption=STAGE_COLUMNS_CAPTION, caption_justify="left")
    columns = ("stage", "why", "strategy", "iterations", "tokens", "wall s", "tokens/s", "predicted",
               "from", "pred/meas", "eval ppl")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="left" if column in ("why", "strategy", "from") else "right")
    for row in stage_rows(run_dir, state, stages):
        measured, predicted = row["tokens_per_s"], row["predicted_tokens_per_s"]
        table.add_row(
            str(row["stage"]),
            row["action"],
            row["strategy"],
            str(row["iterations"]),
            f"{row['tokens']:,}",
            "-" if row["wall_s"] is None else f"{row['wall_s']:.1f}",
            "-" if measured is None else f"{measured:,.0f}",
            "-" if predicted is None else f"{predicted:,.0f}",
            "-" if predicted is None else row["prediction_basis"],
            "-" if measured is None or predicted is None else f"{predicted / measured:.2f}",
            "-" if row["eval_ppl"] is None else f"{row['eval_ppl']:.1f}",
        )
    buffer = StringIO()
    Console(file=buffer, width=140, force_terminal=False).print(table)
    out(buffer.getvalue().rstrip())
    if target_ppl is not None:
        reached = time_to_target(run_dir, target_ppl)
        if reached is None:
            out(f"--target-ppl {target_ppl:g}: not reached")
        else:
            out(f"--target-ppl {target_ppl:g}: reached after {reached[0]:.1f} s, {reached[1]:,} tokens")
