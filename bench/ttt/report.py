"""Reading the time-to-target benchmark's runs back: one row per run from its run directory, the summary
over the rows (best fixed, the ladder of levels, the online and ramp runs' ratios), the tables, and the
merge of the JSON that several calls wrote."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from .supervise import Supervised

WARMUP_RUN = "warmup"
"""The folder of time_to_target's unreported warm-up run in a --work-dir."""
LADDER = (1.1, 1.25, 1.5, 2.0, 3.0, 4.0, 6.0)
"""The easier levels time_to_target times by default, as multiples of the target perplexity."""


def measured_runs(work_dir: Path) -> list[tuple[str, list[dict[str, Any]]]]:
    """Each reported run of a time_to_target --work-dir that logged anything: (name, metrics records)."""
    runs = []
    for directory in sorted(p for p in work_dir.iterdir() if p.is_dir() and p.name != WARMUP_RUN):
        records = read_jsonl(directory / "logs" / directory.name / "metrics.jsonl")
        if records:
            runs.append((directory.name, records))
    return runs


def seed_dir(work_dir: Path, seed: int) -> Path:
    """The folder of one seed's runs in a time_to_target --work-dir."""
    return work_dir / f"seed{seed}"


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # the torn last line of a killed writer
        if isinstance(record, dict):
            records.append(record)
    return records


def first_at_or_below(records: list[dict[str, Any]], level: float) -> dict[str, Any] | None:
    return next((r for r in records if r.get("eval_ppl") is not None and r["eval_ppl"] <= level), None)


def step_start(record: dict[str, Any]) -> float:
    """When the steps of a record's log interval began."""
    return float(record["time"]) - float(record["step_time_s"]) * int(record.get("steps_in_interval", 1))


def switch_gaps(records: list[dict[str, Any]]) -> list[float]:
    """Per stage change: the last record of one stage until the first step of the next (save, publish,
    restart, load, first-step warm-up)."""
    gaps = []
    for before, after in zip(records, records[1:], strict=False):
        if after.get("stage") != before.get("stage"):
            gaps.append(step_start(after) - float(before["time"]))
    return gaps


def strategy_label(record: dict[str, Any]) -> str:
    """``dp2/tp1/pp1 gbs16/mbs8`` (the layout only where the line names it)."""
    layout = "/".join(f"{key}{record[key]}" for key in ("dp", "tp", "pp") if key in record)
    return f"{layout + ' ' if layout else ''}gbs{record['gbs']}/mbs{record['mbs']}"


def stage_strategies(records: list[dict[str, Any]]) -> list[str]:
    labels: list[str] = []
    stage = None
    for record in records:
        if record.get("stage") != stage:
            stage = record.get("stage")
            labels.append(strategy_label(record))
    return labels


def _elapsed(record: dict[str, Any] | None, since: float | None) -> float | None:
    return None if record is None or since is None else round(float(record["time"]) - since, 2)


def summarize_run(
    *,
    name: str,
    kind: str,
    seed: int,
    run_dir: Path,
    supervised: Supervised,
    target_ppl: float,
    levels: list[float],
    seq: int,
) -> dict[str, Any]:
    """One table row from the run directory (metrics.jsonl, decisions.jsonl, realized_chain.json).
    Times to target and to each level are given from the launch and from the first training step's start
    (so that start-up, the same cost for any run length, can be told apart from training)."""
    records = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "time" in r and "step_time_s" in r]
    decisions = read_jsonl(run_dir / "decisions.jsonl")
    realized = run_dir / "realized_chain.json"
    hit = first_at_or_below(records, target_ppl)
    upto = records[: records.index(hit) + 1] if hit is not None else records
    evals = [r for r in upto if r.get("eval_ppl") is not None]
    steps_s = sum(float(r["step_time_s"]) * int(r.get("steps_in_interval", 1)) for r in upto)
    tokens = sum(int(r["gbs"]) * seq * int(r.get("steps_in_interval", 1)) for r in upto)
    all_evals = [r["eval_ppl"] for r in records if r.get("eval_ppl") is not None]
    launched = supervised.launched_at
    first_step = step_start(records[0]) if records else None
    reached = {f"{level:g}": first_at_or_below(records, level) for level in levels}
    return {
        "run": name,
        "kind": kind,
        "seed": seed,
        "reached": hit is not None,
        "time_to_target_s": _elapsed(hit, launched),
        "time_to_target_from_first_step_s": _elapsed(hit, first_step),
        "tokens_to_target": None if hit is None else int(hit["consumed_tokens"]),
        "eval_spacing_s": round(evals[-1]["time"] - evals[-2]["time"], 2) if len(evals) > 1 else None,
        "startup_s": None if first_step is None else round(first_step - launched, 2),
        "runner_s": runner_seconds(run_dir, launched),
        "switch_gaps_s": [round(gap, 2) for gap in switch_gaps(upto)],
        "training_s": round(steps_s, 2),
        "mean_tokens_per_s": round(tokens / steps_s) if steps_s > 0 else None,
        "stages": stage_strategies(upto),
        "switches": _switches(kind, decisions, upto),
        "final_ppl": all_evals[-1] if all_evals else None,
        "best_ppl": min(all_evals) if all_evals else None,
        "realized_chain": json.loads(realized.read_text()) if realized.is_file() else None,
        "wall_s": round(supervised.ended_at - launched, 2),
        "last_line_s": _elapsed(records[-1] if records else None, launched),
        "stop": supervised.stop,
        "exit_code": supervised.exit_code,
        "time_to_level_s": {level: _elapsed(r, launched) for level, r in reached.items()},
        "time_to_level_from_first_step_s": {level: _elapsed(r, first_step) for level, r in reached.items()},
        "tokens_to_level": {
            level: None if r is None else int(r["consumed_tokens"]) for level, r in reached.items()
        },
    }


def _switches(kind: str, decisions: list[dict[str, Any]], records: list[dict[str, Any]]) -> int:
    """Switches carried out: an online run's from its decisions, a chain's from its stage changes."""
    if kind != "online":
        return len(switch_gaps(records))
    carried = sum(1 for d in decisions if d.get("decision") in ("switch", "fallback"))
    return carried - sum(1 for d in decisions if d.get("decision") == "not_carried_out")


def runner_seconds(run_dir: Path, launched: float) -> float | None:
    """Launch until the runner planned the run's first stage (``planned_at`` in ``runner_state.json``): its
    own start-up and, online, the initial search; the workers' start follows (the same code in every mode)."""
    try:
        planned_at = json.loads((run_dir / "runner_state.json").read_text())["stages"][0]["planned_at"]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None
    return None if planned_at is None else round(float(planned_at) - launched, 2)


CHARGES = ("runner", "startup")
"""What a run that is not fixed is charged beyond the quickest fixed run's, on top of its time from its
first step: ``runner``, its runner's start-up until the first stage is planned (what online mode adds to
the start-up: its imports, its initial search), where every row has it, else ``startup``; ``startup``, the
whole start-up, the workers' too (their start differs from run to run by seconds, in every mode)."""


def charged_time(
    row: dict[str, Any], level: str, fixed_least: dict[str, float | None], charge: str
) -> float | None:
    """A run's time to ``level`` from its first step, plus the ``charge`` (see :data:`CHARGES`) it took
    beyond the least a fixed run took (``fixed_least``: per charge)."""
    own = row["time_to_level_from_first_step_s"].get(level)
    if own is None:
        return None
    key = "runner_s" if charge == "runner" and fixed_least.get("runner_s") is not None else "startup_s"
    extra = 0.0
    if fixed_least.get(key) is not None and row.get(key) is not None and row["kind"] != "fixed":
        extra = max(0.0, row[key] - fixed_least[key])
    return round(own + extra, 2)


def ladder_summary(rows: list[dict[str, Any]], levels: list[str]) -> dict[str, dict[str, Any]]:
    """Per level: the best fixed run there (by time from its first step) and the other runs' time over it,
    charged for the runner's extra start-up (``over_best_fixed``) and for the whole extra start-up
    (``over_best_fixed_whole_startup``)."""
    fixed = [r for r in rows if r["kind"] == "fixed"]
    fixed_least: dict[str, float | None] = {}
    for key in ("runner_s", "startup_s"):
        values = [r.get(key) for r in fixed]
        fixed_least[key] = min(values) if values and all(v is not None for v in values) else None
    if any(r.get("runner_s") is None for r in rows):
        fixed_least["runner_s"] = None
    result = {}
    for level in levels:
        entry: dict[str, Any] = {"best_fixed": None}
        for charge, suffix in zip(CHARGES, ("", "_whole_startup"), strict=True):
            times = {r["run"]: charged_time(r, level, fixed_least, charge) for r in rows}
            entry[f"times_from_first_step_s{suffix}"] = times
            reached = [r for r in fixed if times[r["run"]] is not None]
            if reached:
                best = min(reached, key=lambda r: times[r["run"]])
                entry["best_fixed"], best_s = best["run"], times[best["run"]]
                entry["best_fixed_s"] = best_s
                entry[f"over_best_fixed{suffix}"] = {
                    r["run"]: round(times[r["run"]] / best_s, 3)
                    for r in rows
                    if r["kind"] != "fixed" and times[r["run"]] is not None and best_s > 0
                }
        result[level] = entry
    return result


def main_level(ladder: dict[str, dict[str, Any]], min_training_s: float) -> str | None:
    """The hardest level reached by a fixed run, unless that needs less than ``min_training_s`` (then none):
    levels are listed hardest first; the comparison is meant where training, not start-up, dominates."""
    for level, entry in ladder.items():
        if entry.get("best_fixed") is not None:
            return level if entry["best_fixed_s"] >= min_training_s else None
    return None


def summary(
    rows: list[dict[str, Any]], levels: list[str] | None = None, min_training_s: float = 40.0
) -> dict[str, Any]:
    """Best and worst fixed run by time to target from launch (a run that did not reach it is slower than
    any that did), the online run's time over each, and the same from the first step at every level.
    ``fixed_stopped_before_best`` names the fixed runs stopped (capped) before the best one's time: while
    it is not empty, the best fixed run is not established. ``online_stopped_before_best`` names the online
    runs stopped so: their comparison is open (not a loss)."""
    fixed = [r for r in rows if r["kind"] == "fixed"]
    onlines = [r for r in rows if r["kind"] == "online"]  # online and its variants (--online-variant)
    online = next((r for r in onlines if r["run"] == "online"), onlines[0] if onlines else None)
    result: dict[str, Any] = {"fixed_tried": [r["run"] for r in fixed]}
    if not rows:
        return {**result, "ladder": {}, "main_level": None}
    levels = levels if levels is not None else list(rows[0]["time_to_level_from_first_step_s"])
    result["ladder"] = ladder_summary(rows, levels)
    result["main_level"] = main_level(result["ladder"], min_training_s)
    if fixed:
        ordered = sorted(fixed, key=lambda r: r["time_to_target_s"] if r["reached"] else math.inf)
        result.update(best_fixed=ordered[0]["run"], worst_fixed=ordered[-1]["run"])
        for label, row in (("best", ordered[0]), ("worst", ordered[-1])):
            if online is not None and online["reached"] and row["reached"]:
                result[f"online_over_{label}_fixed"] = round(
                    online["time_to_target_s"] / row["time_to_target_s"], 3
                )
        if ordered[0]["reached"]:
            # A fixed run stopped short of the target before the best one reached it might have beaten it.
            result["fixed_stopped_before_best"] = [
                r["run"]
                for r in fixed
                if not r["reached"] and _trained_until(r) < ordered[0]["time_to_target_s"]
            ]
            # An online run stopped (capped) short of the target before that time might still have beaten
            # it: its comparison is open, not a loss.
            result["online_stopped_before_best"] = [
                r["run"]
                for r in onlines
                if not r["reached"] and _trained_until(r) < ordered[0]["time_to_target_s"]
            ]
        if len(onlines) > 1 and ordered[0]["reached"]:
            result["over_best_fixed_by_run"] = {
                r["run"]: round(r["time_to_target_s"] / ordered[0]["time_to_target_s"], 3)
                for r in onlines
                if r["reached"]
            }
    result["main_level_rule"] = f"hardest level a fixed run reached, if it took >= {min_training_s:g} s"
    return result


def seeds_summary(
    rows: list[dict[str, Any]], levels: list[str], min_training_s: float = 40.0
) -> dict[str, Any]:
    """The summary of each seed's rows (:func:`summary`) and, over the seeds, per level and run: the mean
    time from the first step (charged as each seed's ladder charges it) and the mean tokens, given only where
    every seed's run reached the level; the best fixed run by that mean and every run's mean over it. The
    main level is the hardest one whose best fixed mean needs ``min_training_s``."""
    seeds = sorted({int(r.get("seed", 0)) for r in rows})
    by_seed = {seed: summary([r for r in rows if int(r.get("seed", 0)) == seed], levels, min_training_s)
               for seed in seeds}  # fmt: skip
    names = list(dict.fromkeys(r["run"] for r in rows))
    kinds = {r["run"]: r["kind"] for r in rows}
    ladder: dict[str, dict[str, Any]] = {}
    for level in levels:
        runs: dict[str, dict[str, Any]] = {}
        for name in names:
            times, tokens = [], []
            for seed in seeds:
                row = next((r for r in rows if r["run"] == name and int(r.get("seed", 0)) == seed), None)
                if row is None:
                    continue
                times.append(by_seed[seed]["ladder"][level]["times_from_first_step_s"].get(name))
                tokens.append(row.get("tokens_to_level", {}).get(level))
            complete = bool(times) and all(t is not None for t in times) and len(times) == len(seeds)
            runs[name] = {
                "seeds": len(times),
                "reached": sum(t is not None for t in times),
                "mean_time_s": round(sum(times) / len(times), 2) if complete else None,
                "mean_tokens": round(sum(tokens) / len(tokens)) if complete and None not in tokens else None,
            }
        fixed = {n: e["mean_time_s"] for n, e in runs.items() if kinds[n] == "fixed" and e["mean_time_s"]}
        entry: dict[str, Any] = {"runs": runs, "best_fixed": None}
        if fixed:
            best = min(fixed, key=fixed.__getitem__)
            entry |= {"best_fixed": best, "best_fixed_s": fixed[best]}
            entry["over_best_fixed"] = {
                n: round(e["mean_time_s"] / fixed[best], 3) for n, e in runs.items() if e["mean_time_s"]
            }
        ladder[level] = entry
    return {
        "seeds": seeds,
        "by_seed": by_seed,
        "ladder": ladder,
        "main_level": main_level(ladder, min_training_s),
    }


def _tokens_text(tokens: int | None) -> str:
    if tokens is None:
        return "-"
    return f"{tokens / 1e6:.2f}M" if tokens >= 1e6 else f"{tokens:,} tokens"


def format_seeds_ladder(ladder: dict[str, dict[str, Any]], seeds: list[int]) -> str:
    """Per level, the mean over the seeds: each run's time from its first step, tokens and ratio to the best
    fixed run's mean time."""
    lines = [f"mean over seeds {', '.join(map(str, seeds))} (time from the first step; tokens):"]
    for level, entry in ladder.items():
        parts = []
        for name, run in entry["runs"].items():
            if run["mean_time_s"] is None:
                parts.append(f"{name} {run['reached']}/{run['seeds']} reached")
                continue
            ratio = entry.get("over_best_fixed", {}).get(name)
            tokens = _tokens_text(run["mean_tokens"])
            parts.append(f"{name} {run['mean_time_s']:.1f} s {tokens}" + (f" {ratio:.2f}x" if ratio else ""))
        best = entry["best_fixed"] or "none"
        lines.append(f"  ppl {level:>8} (best fixed {best}): {'; '.join(parts) or '-'}")
    return "\n".join(lines)


def _trained_until(row: dict[str, Any]) -> float:
    """Seconds from launch to the run's last metrics line (its exit in reports written before the field)."""
    return float((row["last_line_s"] if "last_line_s" in row else row["wall_s"]) or 0.0)


def format_table(rows: list[dict[str, Any]], target_ppl: float) -> str:
    def number(value: Any, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    width = max([14, *(len(row["run"]) for row in rows)])  # an online variant's name may be longer
    header = (
        f"{'run':<{width}} {'seed':>5} {'to P=' + format(target_ppl, 'g') + ' s':>11} {'1st step':>9} "
        f"{'tokens':>11} {'startup s':>9} {'switch gaps s':>14} {'eval every s':>12} {'final ppl':>9} "
        f"{'tok/s':>9}  "
        "stages (switches)"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        # Not reached: how far it trained (its last line), not its exit, which adds the stop's save.
        ttt = number(row["time_to_target_s"], ".1f") if row["reached"] else f">{_trained_until(row):.0f}"
        gaps = "+".join(f"{gap:.1f}" for gap in row["switch_gaps_s"]) or "-"
        lines.append(
            f"{row['run']:<{width}} {row.get('seed', '-'):>5} {ttt:>11} "
            f"{number(row['time_to_target_from_first_step_s'], '.1f'):>9} "
            f"{number(row['tokens_to_target'], ','):>11} {number(row['startup_s'], '.1f'):>9} {gaps:>14} "
            f"{number(row['eval_spacing_s'], '.1f'):>12} {number(row['final_ppl'], '.1f'):>9} "
            f"{number(row['mean_tokens_per_s'], ','):>9}  "
            f"{' -> '.join(row['stages']) or '-'} ({row['switches']}); stop: {row['stop']}"
        )
    return "\n".join(lines)


def format_ladder(ladder: dict[str, dict[str, Any]]) -> str:
    """One line per level: the best fixed run's time from its first step, and the others' ratios to it."""
    lines = []
    for level, entry in ladder.items():
        if entry.get("best_fixed") is None:
            lines.append(f"  ppl {level:>8}: no fixed run reached it")
            continue
        whole = entry.get("over_best_fixed_whole_startup", {})
        ratios = (
            ", ".join(
                f"{run} {ratio:.2f}x ({whole[run]:.2f}x charged all its extra start-up)"
                if run in whole
                else f"{run} {ratio:.2f}x"
                for run, ratio in entry["over_best_fixed"].items()
            )
            or "-"
        )
        lines.append(
            f"  ppl {level:>8}: best fixed {entry['best_fixed']} {entry['best_fixed_s']:.1f} s; {ratios}"
        )
    return "\n".join(lines)


# --- merging the JSON of several calls ----------------------------------------------------------------------

MUST_MATCH = ("model", "corpus", "data_prefix", "target_ppl", "total_tokens", "warmup_tokens",
              "eval_every_tokens", "initial_gbs", "max_gbs", "levels", "compile", "seq", "gpus")  # fmt: skip
"""Settings under which rows of different calls are comparable; a merge refuses others."""


def merge_reports(reports: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """One report of the rows of several (a later call's row replaces an earlier one of the same run and
    seed)."""
    if not reports:
        raise ValueError("--merge: no report given")
    first_name, first = reports[0]
    rows: dict[tuple[int, str], dict[str, Any]] = {}
    for name, report in reports:
        for key in MUST_MATCH:
            if report["settings"].get(key) != first["settings"].get(key):
                raise ValueError(
                    f"--merge: {name} has {key}={report['settings'].get(key)!r}, "
                    f"{first_name} has {first['settings'].get(key)!r}"
                )
        rows.update(((int(row.get("seed", 0)), row["run"]), row) for row in report["runs"])
    settings = {**first["settings"], "merged_from": [name for name, _ in reports]}
    settings["seeds"] = sorted({seed for seed, _ in rows})
    headroom = {seed: h for _, report in reports for seed, h in report.get("headroom", {}).items()}
    return {"settings": settings, "runs": list(rows.values()), "headroom": headroom}
