"""Run directories shaped like ``cona demo``'s online run, written without training, for the report's figure
tests: seven stages (gbs 1 -> 2 -> 4 through checkpoints, then in place up to 16 with a fallback between),
a metrics line every 2 iterations, an evaluation every 20, one decision per switch with the cost it charged,
the stage results' timings and the run state's switch costs, at the demo's scale (~35 s, 40k tokens)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from cona.runner.state import RunState, StageState, save_state

SEQ = 128
STAGES = (  # dp, tp, pp, mbs, gbs, iterations, how it was entered
    (1, 4, 1, 1, 1, 9, "initial"),
    (2, 2, 1, 1, 2, 5, "switch"),
    (4, 1, 1, 1, 4, 7, "switch"),
    (4, 1, 1, 2, 8, 8, "switch"),
    (4, 1, 1, 1, 4, 14, "fallback"),
    (4, 1, 1, 2, 8, 5, "switch"),
    (4, 1, 1, 4, 16, 5, "switch"),
)
LOG_INTERVAL = 2
EVAL_INTERVAL = 20


def write_demo_like_run(run_dir: Path, *, seed: int = 0, start: float = 1.8e9) -> Path:
    """Write the run directory (metrics, decisions, stage results and specs, run state); returns it."""
    rng = np.random.default_rng(seed)
    run_dir.mkdir(parents=True)
    metrics, decisions, states = [], [], []
    iteration, samples, clock = 0, 0, start
    for number, (dp, tp, pp, mbs, gbs, iterations, _) in enumerate(STAGES, start=1):
        strategy = {"dp": dp, "tp": tp, "pp": pp, "mbs": mbs, "gbs": gbs}
        through_checkpoint = number <= 3
        start_up = (10.8 if number == 1 else 2.6) if through_checkpoint else 0.02
        first_step = 1.7 if through_checkpoint else 0.3
        step_s = 0.15 * gbs**0.6 * rng.uniform(0.9, 1.1)
        timings = {"launch": clock, "process_start": clock + start_up}
        timings["first_step_done"] = timings["process_start"] + first_step
        first_iteration = logged = iteration
        for _ in range(iterations):
            iteration += 1
            samples += gbs
            if iteration % LOG_INTERVAL and iteration != first_iteration + iterations:
                continue
            logged_at = timings["first_step_done"] + (iteration - first_iteration - 1) * step_s
            record = {
                "stage": number, "iteration": iteration, "consumed_samples": samples,
                "consumed_tokens": samples * SEQ, "loss": 8.35 - 0.0045 * samples + rng.normal(0, 0.01),
                "lr": 1e-3, **strategy, "step_time_s": step_s, "tokens_per_s": gbs * SEQ / step_s,
                "grad_norm": 1.5, "gns_small_sqr": 5.8, "gns_big_sqr": 3.0 + rng.uniform(0, 0.5),
                "gns_small_batch": 1, "gns_big_batch": max(2, gbs), "steps_in_interval": iteration - logged,
                "skipped_steps": 0, "time": logged_at,
            }  # fmt: skip
            if iteration % EVAL_INTERVAL == 0:
                record["eval_ppl"] = 4000.0 * np.exp(-samples / 150)
                record["eval_loss"] = float(np.log(record["eval_ppl"]))
            metrics.append(record)
            logged = iteration
        timings["train_done"] = timings["first_step_done"] + (iterations - 1) * step_s
        timings["save_done"] = timings["train_done"] + (1.0 if number < 3 else 0.0)
        clock = timings["save_done"] + 0.05
        stage_dir = run_dir / "stages" / str(number)
        stage_dir.mkdir(parents=True)
        reason = (
            "completed" if number == len(STAGES) else "switch_requested" if number < 3 else "switch_in_place"
        )
        result = {
            "stage": number, "reason": reason, "last_iteration": iteration, "consumed_samples": samples,
            "consumed_tokens": samples * SEQ, "checkpoint": None, "timings": timings,
        }  # fmt: skip
        (stage_dir / "stage_result.json").write_text(json.dumps(result))
        spec = {"config": {"training": {"base_gbs": 8}}}
        (stage_dir / "spec.json").write_text(json.dumps(spec))
        cost = {"first_step_s": first_step} | (
            {"load_s": start_up, "save_s": 1.0} if through_checkpoint else {}
        )
        states.append(
            StageState(
                step_num=number, status="done", last_iteration=iteration, consumed_samples=samples,
                consumed_tokens=samples * SEQ, timings=timings, switch_cost=cost if number > 1 else {},
            )
        )  # fmt: skip
        if number < len(STAGES):
            following = STAGES[number]
            decisions.append(
                {
                    "stage": number, "iteration": iteration - 1, "time": timings["train_done"],
                    "decision": following[6], "switch_cost_s": 4.2 if number < 3 else 0.4,
                    "current_predicted_tokens_per_s": gbs * SEQ / step_s * 1.1,
                    "candidate": {"predicted_tokens_per_s": following[4] * SEQ / step_s},
                }
            )  # fmt: skip
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in metrics))
    (run_dir / "decisions.jsonl").write_text("".join(json.dumps(entry) + "\n" for entry in decisions))
    save_state(
        run_dir,
        RunState(chain_path="online", chain_digest="", config_digest="", world_size=4, stages=tuple(states)),
    )
    return run_dir
