"""Read a run directory for ``cona report`` and ``cona status``, and build the report.

A run directory (see :mod:`cona.runner.run_dir`) may belong to a run that is still going: the last line of
``metrics.jsonl`` can be half written, a stage may have no ``stage_result.json`` yet, and the run state may
lag behind. Everything here reads what is there, turns what it cannot read into a warning that names the
file (and line), and never raises for a damaged file; only a directory that is not a run directory at all is
an error.

The figures are drawn by :mod:`cona.runner.views.report_figures`, the page by
:mod:`cona.runner.views.report_html`.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cona import run_files
from cona.engine.spec import stage_wall_s
from cona.errors import ChainError, ConaError, not_found
from cona.jsonl import is_number, read_json, read_json_lines
from cona.metrics_record import MetricsRecord, measured_tokens_per_s
from cona.planner.efficiency import NoiseScaleTracker, statistical_efficiency
from cona.runner.state import RunState, durations, load_state, switch_cost

METRICS_FILE = run_files.METRICS
DECISIONS_FILE = run_files.DECISIONS
REQUIRED_METRIC_KEYS = ("stage", "iteration", "consumed_tokens", "loss", "time")
STRATEGY_KEYS = ("dp", "tp", "pp", "mbs", "gbs")
SWITCH_PARTS = ("probe_s", "save_s", "publish_s", "process_start_s", "load_s", "verify_s", "first_step_s")
"""The parts of a switch's cost, in the order they happen."""


@dataclass(frozen=True, kw_only=True)
class RunData:
    """Everything readable in one run directory."""

    run_dir: Path
    name: str
    """How figures and tables call the run: its directory's name (``latest`` resolved)."""
    metrics: tuple[dict[str, Any], ...]
    """One line per iteration (the last one written: a relaunched stage logs some twice), in order, as
    decoded (the figures plot its keys); :attr:`records` has them typed."""
    stage_results: dict[int, dict[str, Any]]
    """``stages/<N>/stage_result.json`` of the stages that finished."""
    specs: dict[int, dict[str, Any]]
    """``stages/<N>/spec.json`` as written by the runner."""
    state: RunState | None
    """``runner_state.json`` (chains only)."""
    decisions: tuple[dict[str, Any], ...]
    warnings: tuple[str, ...]

    @functools.cached_property
    def records(self) -> tuple[MetricsRecord, ...]:
        """:attr:`metrics` as records (every line was checked to be one when it was read)."""
        return tuple(MetricsRecord.from_dict(line) for line in self.metrics)

    def training_setting(self, key: str) -> Any:
        """A ``training`` key of the run's resolved config (from the first stage spec), or None."""
        for number in sorted(self.specs):
            value = self.specs[number].get("config", {}).get("training", {}).get(key)
            if value is not None:
                return value
        return None


@dataclass(frozen=True, kw_only=True)
class StageSummary:
    """One stage as the metrics show it."""

    stage: int
    strategy: dict[str, int]
    first_iteration: int
    """The first iteration it trained (its first logged line's, less the other steps that line reports)."""
    last_iteration: int
    start_tokens: int
    """Tokens consumed when the stage started (the previous stage's last record; 0 for the first)."""
    end_tokens: int
    start_time: float
    """Unix time the stage's processes started (the first record's interval start when not recorded)."""
    end_time: float
    """Unix time the stage finished saving (its last record when not recorded)."""
    ready_time: float
    """Unix time its first step finished (the end of the switch into it); its first logged interval's start
    when not recorded."""
    train_end: float
    """Unix time its training ended (its last record when not recorded)."""
    tokens_per_s: float | None
    """Its measured rate: the median of its steady log intervals (:func:`measured_tokens_per_s`, as the
    policy and the console's summary take it)."""
    wall_s: float | None
    """Its launch to the end of its save (:func:`cona.engine.spec.stage_wall_s`, as the console's summary
    gives it); None where the stage result does not record both."""
    last_eval_ppl: float | None
    reason: str | None
    """Why it stopped (stage_result.json); None while it runs."""

    @property
    def label(self) -> str:
        return strategy_label(self.strategy)


@dataclass(frozen=True, kw_only=True)
class SwitchCost:
    into_stage: int
    parts: dict[str, float]
    """Seconds per part of :data:`SWITCH_PARTS` that was measured."""
    source: str
    """``runner_state.json`` or ``stage_result.json`` (the latter has no process start or publish)."""


@dataclass(frozen=True, kw_only=True)
class NoisePoint:
    tokens: int
    noise_scale: float
    """Smoothed gradient noise scale in samples."""
    gbs: int
    efficiency: float
    """Statistical efficiency of the gbs in use, relative to training.base_gbs."""


def strategy_label(strategy: dict[str, Any]) -> str:
    return "dp{dp} tp{tp} pp{pp} mbs{mbs} gbs{gbs}".format(**{k: strategy.get(k, "?") for k in STRATEGY_KEYS})


def load_run(run_dir: Path) -> RunData:
    """Read a run directory (finished or running). Raises :class:`ConaError` only when it is not one."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConaError(f"run directory {run_dir} {not_found(run_dir, 'directory')}")
    metrics_path = run_dir / METRICS_FILE
    if not metrics_path.exists() and not run_files.stages_path(run_dir).is_dir():
        raise ConaError(f"{run_dir} is not a run directory: it has no {METRICS_FILE} and no stages/")
    metrics = read_json_lines(metrics_path, required=REQUIRED_METRIC_KEYS, check=MetricsRecord.from_dict)
    decisions = read_json_lines(run_dir / DECISIONS_FILE)
    warnings = [*metrics.warnings, *decisions.warnings]
    results = _read_stage_files(run_dir, run_files.STAGE_RESULT, warnings)
    specs = _read_stage_files(run_dir, run_files.SPEC, warnings)
    state = None
    try:
        state = load_state(run_dir)
    except (ChainError, OSError) as err:
        warnings.append(
            f"{run_files.runner_state_path(run_dir)}: unreadable ({err}); switch costs from stage results"
        )
    if not metrics.records:
        warnings.append(f"{metrics_path}: no metrics yet")
    return RunData(
        run_dir=run_dir,
        name=run_dir.resolve().name,
        metrics=_last_per_iteration(metrics.records),
        stage_results=results,
        specs=specs,
        state=state,
        decisions=decisions.records,
        warnings=tuple(warnings),
    )


def _read_stage_files(run_dir: Path, name: str, warnings: list[str]) -> dict[int, dict[str, Any]]:
    found: dict[int, dict[str, Any]] = {}
    for path in sorted(run_files.stages_path(run_dir).glob(f"*/{name}")):
        if not path.parent.name.isdigit():
            continue
        try:
            document = read_json(path)
        except (OSError, json.JSONDecodeError) as err:
            warnings.append(f"{path}: unreadable ({err}); ignored")
            continue
        if isinstance(document, dict):
            found[int(path.parent.name)] = document
        else:
            warnings.append(f"{path}: not a JSON object; ignored")
    return found


def _last_per_iteration(records: Sequence[dict[str, Any]]) -> tuple[dict[str, Any], ...]:
    by_iteration = {int(record["iteration"]): record for record in records}
    return tuple(by_iteration[iteration] for iteration in sorted(by_iteration))


def _finite(value: Any) -> float | None:
    return float(value) if is_number(value) and math.isfinite(value) else None


def run_start_time(run: RunData) -> float | None:
    """Unix time the run's first processes started: stage 1's recorded start, else the start of the first
    logged interval."""
    candidates = [
        result["timings"]["process_start"]
        for result in run.stage_results.values()
        if is_number(result.get("timings", {}).get("process_start"))
    ]
    if run.records:
        candidates.append(_interval_start(run.records[0]))
    return min(candidates) if candidates else None


def _interval_start(record: MetricsRecord) -> float:
    """When the steps a record reports began (its time minus their step times)."""
    steps = record.steps_in_interval or 1
    return float(record.time) - steps * (_finite(record.step_time_s) or 0.0)


def stage_summaries(run: RunData) -> list[StageSummary]:
    """The stages seen in the metrics, in the order they ran."""
    summaries: list[StageSummary] = []
    for stage, records in _records_by_stage(run.records):
        result = run.stage_results.get(stage, {})
        timings = result.get("timings", {})
        evals = [_finite(record.eval_ppl) for record in records]
        evals = [value for value in evals if value is not None]
        last = records[-1]
        summaries.append(
            StageSummary(
                stage=stage,
                strategy={key: int(getattr(last, key) or 0) for key in STRATEGY_KEYS},
                first_iteration=int(records[0].iteration) - (records[0].steps_in_interval or 1) + 1,
                last_iteration=int(last.iteration),
                start_tokens=summaries[-1].end_tokens if summaries else 0,
                end_tokens=int(last.consumed_tokens),
                start_time=timings.get("process_start", _interval_start(records[0])),
                end_time=timings.get("save_done", float(last.time)),
                ready_time=timings.get("first_step_done", _interval_start(records[0])),
                train_end=timings.get("train_done", float(last.time)),
                tokens_per_s=measured_tokens_per_s(records),
                wall_s=stage_wall_s(timings),
                last_eval_ppl=evals[-1] if evals else None,
                reason=result.get("reason"),
            )
        )
    return summaries


def _records_by_stage(metrics: Sequence[MetricsRecord]) -> list[tuple[int, list[MetricsRecord]]]:
    groups: list[tuple[int, list[MetricsRecord]]] = []
    for record in metrics:
        stage = int(record.stage)
        if groups and groups[-1][0] == stage:
            groups[-1][1].append(record)
        else:
            groups.append((stage, [record]))
    return groups


def switch_costs(run: RunData) -> list[SwitchCost]:
    """The measured cost of each switch, split into :data:`SWITCH_PARTS`: from the run state when the
    runner kept it (chains), else from the workers' stage results (no process start, no publish)."""
    if run.state is not None:
        return _switch_costs_from_state(run.state)
    costs = []
    numbers = sorted(run.stage_results)
    for previous, stage in zip(numbers, numbers[1:], strict=False):
        before = durations(run.stage_results[previous].get("timings", {}), None)
        after = durations(run.stage_results[stage].get("timings", {}), None)
        parts = {
            "probe_s": before.get("probe_s"),
            "save_s": before.get("save_s"),
            **{key: after.get(key) for key in ("load_s", "verify_s", "first_step_s")},
        }
        parts = {key: value for key, value in parts.items() if value is not None}
        if parts:
            costs.append(SwitchCost(into_stage=stage, parts=parts, source=run_files.STAGE_RESULT))
    return costs


def _switch_costs_from_state(state: RunState) -> list[SwitchCost]:
    costs = []
    for previous, stage in zip(state.stages, state.stages[1:], strict=False):
        # A stage records its switch cost when it is done; a later one shows what is measured so far.
        parts = (stage.switch_cost or switch_cost(previous, stage)) if stage.status != "pending" else {}
        if parts:
            source = run_files.RUNNER_STATE
            costs.append(SwitchCost(into_stage=stage.step_num, parts=dict(parts), source=source))
    return costs


def noise_series(run: RunData) -> list[NoisePoint]:
    """The smoothed noise scale after each metrics record (once the tracker has enough measurements),
    with the statistical efficiency of the gbs in use relative to ``training.base_gbs``."""
    base = base_batch(run)
    tracker = NoiseScaleTracker(base_batch=base)
    points = []
    for record in run.records:
        tracker = tracker.update_from_metrics(record)
        phi = tracker.noise_scale()
        if phi is None or record.gbs is None:
            continue
        gbs = int(record.gbs)
        efficiency = float(statistical_efficiency(gbs, phi, base))
        points.append(
            NoisePoint(tokens=int(record.consumed_tokens), noise_scale=phi, gbs=gbs, efficiency=efficiency)
        )
    return points


def base_batch(run: RunData) -> int:
    """``training.base_gbs`` of the run (the first gbs when the run has no stage spec)."""
    base = run.training_setting("base_gbs")
    if is_number(base) and base > 0:
        return int(base)
    first = next((record.gbs for record in run.records if record.gbs is not None), 1)
    return max(int(first), 1)


def predicted_throughput(run: RunData, stages: Sequence[StageSummary]) -> dict[int, float]:
    """Predicted tokens/s per stage, from ``decisions.jsonl`` (:mod:`cona.planner.policy` records): what the
    model predicted for the strategy a decision was made under, and, for a switch, for the candidate that
    the next stage runs. Later decisions win."""
    predicted: dict[int, float] = {}
    for decision in run.decisions:
        stage = decision_stage(decision, stages)
        if stage is None:
            continue
        current = _finite(decision.get("current_predicted_tokens_per_s"))
        if current is not None:
            predicted[stage] = current
        candidate = decision.get("candidate")
        if decision.get("decision") == "switch" and isinstance(candidate, dict):
            value = _finite(candidate.get("predicted_tokens_per_s"))
            if value is not None:
                predicted[stage + 1] = value
    return predicted


def charged_switch_costs(run: RunData, stages: Sequence[StageSummary]) -> dict[int, float]:
    """The switch cost (s) each switch or fallback decision charged, by the stage the switch led into."""
    charged = {}
    for decision in run.decisions:
        stage = decision_stage(decision, stages)
        cost = _finite(decision.get("switch_cost_s"))
        if decision.get("decision") in ("switch", "fallback") and stage is not None and cost is not None:
            charged[stage + 1] = cost
    return charged


def decision_stage(decision: dict[str, Any], stages: Sequence[StageSummary]) -> int | None:
    """The stage a decision was made in: the newest one that had logged by its iteration (a decision before
    the first record belongs to the first stage)."""
    iteration = decision.get("iteration")
    if not is_number(iteration) or not stages:
        return None
    within = [stage.stage for stage in stages if stage.first_iteration <= iteration]
    return within[-1] if within else stages[0].stage
