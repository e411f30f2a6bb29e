"""The search beside an online stage: a daemon thread of the runner that reads ``metrics.jsonl`` as it grows.

At every new batch of metrics lines it folds the gradient-noise measurements into the noise-scale tracker,
measures the running strategy's throughput (median over the stage's steady log intervals: the first one left
out, it holds the start-up, and any warm-up after it; the estimator's until the run measured any), asks the
planner for the frontier candidate (:func:`cona.planner.policy.next_frontier` over the best strategy of each
larger gbs by the run's throughput estimator, :mod:`cona.planner.throughput`) and lets
:func:`cona.planner.policy.decide` choose. Every evaluation is appended to ``decisions.jsonl``. A switch or
fall-back writes ``switch_request.json`` (atomically); the workers see it at the next step boundary, save
and exit, and the runner carries the switch out. A stop at ``--target-ppl`` travels the same way. A request
that comes after the stage's last step boundary is logged as not carried out (:func:`log_not_carried_out`).

The thread only reads files the workers append to and writes files they poll, so it never waits on them
and they never wait on it; it runs on the CPU of the runner process (measured in docs/benchmarks.md).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cona import run_files
from cona.jsonl import JsonlTail
from cona.metrics_record import MetricsRecord, metrics_records, stage_rates, steady_rates
from cona.planner.efficiency import NoiseScaleEstimate, NoiseScaleTracker
from cona.planner.policy import (
    Candidate,
    Decision,
    Measurement,
    PolicySettings,
    PolicyState,
    after_switch,
    decide,
    next_frontier,
    refresh_predicted_rates,
    strategy_dict,
)
from cona.planner.probe_rule import ProbeOutcome
from cona.runner.schedules.frontier import FrontierSearch
from cona.runner.views.run_tracker import RunTracker
from cona.strategy import Strategy
from cona.switch_request import ProbeAsk, SwitchRequest

DECISIONS_NAME = run_files.DECISIONS
POLL_INTERVAL_S = 0.05
"""Seconds between reads of the metrics file. A read that finds no new line opens the file and reads
nothing; a decision waits half of this on average, and the workers train on meanwhile (at 0.5 s, a
host-bound eager run steps a whole log interval past the line it decided on)."""
PRINT_EVERY_STAY = 5
"""Print one "stay" decision in this many (the first of each stage included)."""
REMEASURE_CHANGE = 0.02
"""Relative change of the running strategy's measured rate that updates its point in the estimator."""


@dataclass(frozen=True, kw_only=True)
class PendingSwitch:
    """A switch the runner carried out whose cost is complete once the new stage has logged its first
    interval: the previous stage's save and publish, then the new stage's start until its first step."""

    new: Candidate
    old_measured_tokens_per_s: float
    old_rate_measured: bool = True
    """False: the previous stage had no steady line; its rate is the estimator's."""
    handoff_s: float
    """Save and publish of the previous stage, measured by the runner."""
    in_place: bool = False
    """The switch kept the state in the workers' memory (its cost is averaged apart)."""


@dataclass(frozen=True, kw_only=True)
class Budget:
    """How much training is left: ``--total-iters`` and/or a token budget (``--total-tokens``, or the LR
    horizon when only ``--target-ppl`` is given); ``--target-ppl`` stops early."""

    total_iters: int | None
    total_tokens: int | None
    target_ppl: float | None
    seq: int

    def remaining_tokens(self, iteration: int, consumed_tokens: int, gbs: int) -> float:
        left = []
        if self.total_iters is not None:
            left.append((self.total_iters - iteration) * gbs * self.seq)
        if self.total_tokens is not None:
            left.append(self.total_tokens - consumed_tokens)
        return float(max(min(left), 0))


@dataclass(frozen=True, kw_only=True)
class StageOutcome:
    """What the thread leaves for the runner when its stage ends."""

    decision: Decision | None
    """The switch or fall-back it requested (None: none)."""
    stop_reason: str | None
    """Set when it requested a stop at --target-ppl."""
    policy_state: PolicyState
    settings: PolicySettings
    tracker: NoiseScaleTracker
    measured_tokens_per_s: float | None
    rate_measured: bool = True
    """False: the stage logged no steady line and the rate is the throughput estimator's."""
    target_reached: dict[str, Any] | None
    """The first metrics record with eval_ppl <= --target-ppl."""


class StageSearch:
    """The search of one stage; :meth:`poll` does one round (tests call it directly), :meth:`start` runs
    rounds in a daemon thread until :meth:`stop`."""

    def __init__(
        self,
        *,
        run_dir: Path,
        stage: int,
        launched_at: float,
        settings: PolicySettings,
        policy_state: PolicyState,
        tracker: NoiseScaleTracker,
        frontier: FrontierSearch | Callable[[int], Candidate | None],
        budget: Budget,
        pending: PendingSwitch | None = None,
        noise_scale_floor: float | None = None,
        startup_prices_switch: bool = True,
        metrics_offset: int = 0,
        out: Callable[[str], None] = print,
        print_stays: bool = True,
        run_tracker: RunTracker | None = None,
        lr_factors: Callable[[int, int], tuple[float, float]] | None = None,
    ) -> None:
        """``print_stays``: also say some "stay" decisions on ``out`` (switches and stops always are; every
        decision is in decisions.jsonl). Off in quiet mode. ``run_tracker`` gets every decision too.
        ``lr_factors(gbs, iteration)``: the LR and min-LR factors a stage at ``gbs`` from ``iteration``
        trains with, for a probe's candidate branch (None: the base LR)."""
        self.run_dir, self.stage, self.launched_at = run_dir, stage, launched_at
        self.run_tracker = run_tracker if run_tracker is not None else RunTracker.off()
        self.print_stays = print_stays
        self.settings, self.policy_state, self.tracker = settings, policy_state, tracker
        self.frontier, self.budget, self.pending, self.out = frontier, budget, pending, out
        self._measured_rate: float | None = None
        """The running strategy's rate the frontier's estimator last got."""
        self._evaluations = 0
        self.noise_scale_floor = noise_scale_floor
        self.startup_prices_switch = startup_prices_switch
        self.tail = JsonlTail(run_files.metrics_path(run_dir), metrics_offset)
        self.probes = JsonlTail.at_end(run_files.probes_path(run_dir))
        self.lr_factors = lr_factors or (lambda gbs, iteration: (1.0, 1.0))
        self.probing = False
        """A probe was asked for and its outcome not read yet."""
        self._last: MetricsRecord | None = None
        """The stage's last metrics line (what a decision on a probe's outcome is measured at)."""
        self.rate_lines: list[MetricsRecord] = []  # the stage's lines with a tokens/s
        self.decision: Decision | None = None
        self.stop_reason: str | None = None
        self.target_reached: dict[str, Any] | None = None
        self._started_logging = False
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    @property
    def switch_request_path(self) -> Path:
        return run_files.switch_request_path(self.run_dir)

    def measured_tokens_per_s(self) -> float | None:
        """Median over the stage's steady log intervals (:func:`cona.metrics_record.steady_rates`: after the
        first, which holds start-up, and after any further warm-up)."""
        steady = self.steady_rates()
        return statistics.median(steady) if steady else None

    def steady_rates(self) -> list[float]:
        """The tokens/s of the stage's lines that measure its steady rate (``metrics_record``'s rules)."""
        return steady_rates(stage_rates(self.rate_lines))

    def poll(self) -> Decision | None:
        """Read what is new, evaluate once if anything is, and request a switch, probe or stop if due."""
        records = metrics_records(self.tail.new_records())
        if self.probing:  # the workers train on after a lost probe: their lines count
            for record in records:
                self._absorb(record)
            self._note_last(records)
            return self._read_probe()
        if not records or self.requested:
            return None
        for record in records:
            self._absorb(record)
        if self.requested:
            return None
        if not self._note_last(records):
            return None
        assert self._last is not None
        return self._evaluate(self._last)

    def _note_last(self, records: list[MetricsRecord]) -> bool:
        last = next((r for r in reversed(records) if r.stage == self.stage), None)
        if last is None or last.iteration is None:
            return False
        self._last = last
        return True

    def _read_probe(self) -> Decision | None:
        """The outcome of the probe asked for, once the workers wrote it: decided on (a won probe is the
        switch the workers made; a lost or skipped one lets the search go on)."""
        line = next((r for r in self.probes.new_records() if r.get("stage") == self.stage), None)
        if line is None or self._last is None:
            return None
        self.probing = False
        if "skipped" in line:
            self.policy_state = dataclasses.replace(self.policy_state, probing=None)
            self.decision = None
            self.out(f"stage {self.stage}: probe not run: {line['skipped']}")
            return None
        decision = self._evaluate(self._last, probe=ProbeOutcome.from_dict(line))
        self.decision = decision if decision.action == "switch" else None
        return decision

    @property
    def requested(self) -> bool:
        return self.decision is not None or self.stop_reason is not None

    def _absorb(self, record: MetricsRecord) -> None:
        self.tracker = self.tracker.update_from_metrics(record)
        if record.stage != self.stage or record.tokens_per_s is None:
            return
        if not self._started_logging:
            self._started_logging = True
            self._account_start(record)
        self.rate_lines.append(record)
        ppl, target = record.eval_ppl, self.budget.target_ppl
        if target is not None and ppl is not None and ppl <= target and self.target_reached is None:
            self.target_reached = record.to_dict()
            self.stop_reason = f"eval perplexity {ppl:.2f} <= --target-ppl {target:g}"
            self.out(f"stage {self.stage}: {self.stop_reason} at iteration {record.iteration}; stopping")
            SwitchRequest(action="stop", reason=self.stop_reason).write(self.switch_request_path)

    def _account_start(self, record: MetricsRecord) -> None:
        """The first interval of the stage dates its start-up: launch until the first step was done."""
        step_s, steps = record.step_time_s, record.steps_in_interval
        steps_s = float(0.0 if step_s is None else step_s) * int(1 if steps is None else steps)
        startup_s = max(float(_time_of(record)) - self.launched_at - steps_s, 0.0)
        if self.pending is not None:
            self.policy_state = after_switch(
                self.policy_state,
                new=self.pending.new,
                old_measured_tokens_per_s=self.pending.old_measured_tokens_per_s,
                switch_cost_s=self.pending.handoff_s + startup_s,
                in_place=self.pending.in_place,
                old_rate_measured=self.pending.old_rate_measured,
            )
            self.pending = None
        elif self.startup_prices_switch and self.policy_state.measured_switch_cost_s is None:
            # No switch measured yet: a switch costs at least a restart like this one.
            cost_s = max(self.settings.predicted_switch_cost_s, startup_s)
            self.settings = dataclasses.replace(self.settings, predicted_switch_cost_s=cost_s)

    def _evaluate(self, last: MetricsRecord, probe: ProbeOutcome | None = None) -> Decision | None:
        if self.pending is not None and probe is None:
            return None  # the switch into this stage is not accounted yet
        started = time.perf_counter()
        measured, rate_measured = self._current_rate()
        current = self.policy_state.current.strategy
        iteration, tokens = int(last.iteration), int(last.consumed_tokens)
        measurement = Measurement(
            time=float(_time_of(last)),
            iteration=iteration,
            consumed_tokens=tokens,
            noise=self._noise_estimate(),
            noise_measurements=len(self.tracker.measurements),
            measured_tokens_per_s=measured,
            rate_measured=rate_measured,
            remaining_tokens=self.budget.remaining_tokens(iteration, tokens, current.gbs),
            interval_tokens=float(last.steps_in_interval or 1) * current.gbs * self.budget.seq,
            probe=probe,
        )
        if rate_measured:
            self._measure(current, measured)
        candidate = None
        if measured is not None and measurement.noise is not None:
            candidate = next_frontier(current.gbs, measured, self.settings, self.frontier)
        decision = decide(self.policy_state, measurement, candidate, self.settings)
        self.policy_state = decision.state
        self._log(decision, evaluation_s=time.perf_counter() - started)
        if decision.action != "stay" and probe is None:  # after a probe the workers already acted
            self.decision = decision
            ask = self._probe_ask(decision, iteration) if decision.action == "probe" else None
            self.probing = ask is not None
            switch_request(decision, ask).write(self.switch_request_path)
        return decision

    def _probe_ask(self, decision: Decision, iteration: int) -> ProbeAsk:
        """What the workers need for a probe besides its target: the candidate's LR factors (its stage's,
        from the next boundary), the samples per branch and the tolerance."""
        assert decision.target is not None
        lr_factor, min_lr_factor = self.lr_factors(decision.target.strategy.gbs, iteration)
        return ProbeAsk(
            lr_factor=lr_factor,
            min_lr_factor=min_lr_factor,
            samples=-(-self.settings.probe_tokens // self.budget.seq),
            tolerance=self.settings.probe_tolerance,
        )

    def _current_rate(self) -> tuple[float | None, bool]:
        """The running strategy's rate and whether it was measured. Until the run has a steady line it is
        the estimator's (:meth:`FrontierSearch.add_first_line`): the first decision, a probe only, comes at
        the first line, not one line later, when the easiest targets of a short run may already be near."""
        measured = self.measured_tokens_per_s()
        if measured is not None:
            return measured, True
        frontier = self.frontier
        if not isinstance(frontier, FrontierSearch) or not self.rate_lines or self.policy_state.earlier:
            return None, True
        if frontier.estimator.has_own_measurement:  # the run measured a rate: this stage waits for its own
            return None, True
        current = self.policy_state.current.strategy
        frontier.add_first_line(self.rate_lines[0], current, source=f"stage {self.stage} first line")
        return frontier.predicted_tokens_per_s(current), False

    def _noise_estimate(self) -> NoiseScaleEstimate | None:
        """The tracker's estimate, raised to ``noise_scale_floor`` when one is set (the demo's stand-in for
        the larger noise scale of a longer run). An unknown noise scale stays unknown."""
        estimate = self.tracker.estimate()
        floor = self.noise_scale_floor
        if estimate is None or floor is None or estimate.noise_scale is None or estimate.noise_scale >= floor:
            return estimate
        return dataclasses.replace(estimate, trace_sigma=floor * estimate.grad_sqr)

    def _measure(self, current: Strategy, measured: float | None) -> None:
        """The running strategy's measured rate joins the frontier's estimator (replacing this stage's
        previous one; earlier stages' points stay), which refits its shape on every point, when the rate
        moved by more than :data:`REMEASURE_CHANGE` since it last did (a refit is ~0.1 s of CPU)."""
        if measured is None or not isinstance(self.frontier, FrontierSearch):
            return
        last = self._measured_rate
        if last is not None and abs(measured / last - 1.0) <= REMEASURE_CHANGE:
            return
        intervals = len(self.steady_rates())
        self.frontier.add_measurement(current, measured, intervals=intervals, source=f"stage {self.stage}")
        self._measured_rate = measured
        self.policy_state = refresh_predicted_rates(self.policy_state, self.frontier.predicted_tokens_per_s)

    def _log(self, decision: Decision, *, evaluation_s: float) -> None:
        record = {
            "stage": self.stage,
            **decision.record,
            "decided_at": time.time(),
            "evaluation_s": evaluation_s,
            "throughput_fit": self.frontier.estimator.record()
            if isinstance(self.frontier, FrontierSearch)
            else None,
            "hysteresis": self.settings.hysteresis,
        }
        if self.noise_scale_floor is not None:
            record["measured_noise_scale"] = self.tracker.noise_scale()
            record["noise_scale_floor"] = self.noise_scale_floor
        with open(self.run_dir / DECISIONS_NAME, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        self.run_tracker.decision(record)
        self._evaluations += 1
        if decision.action == "stay" and (not self.print_stays or (self._evaluations - 1) % PRINT_EVERY_STAY):
            return  # decisions.jsonl has every evaluation; the console every switch and some stays
        noise = record.get("noise_scale")
        noise_text = f"{noise:.1f}" if noise is not None else "unknown"
        if self.noise_scale_floor is not None and record["measured_noise_scale"] is not None:
            noise_text += f", measured {record['measured_noise_scale']:.1f}, floor {self.noise_scale_floor:g}"
        self.out(
            f"decision at iteration {record['iteration']}: {decision.action} (noise scale {noise_text}): "
            f"{decision.reason}"
        )

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"cona-search-{self.stage}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._halt.wait(POLL_INTERVAL_S):
                self.poll()
        except BaseException as err:  # noqa: BLE001 (reported by stop(), in the runner's thread)
            self.error = err

    def stop(self) -> StageOutcome:
        """Stop the thread, read what the stage logged last, and hand over the outcome."""
        self._halt.set()
        if self._thread is not None:
            self._thread.join()
        if self.error is not None:
            raise self.error
        records = metrics_records(self.tail.new_records())
        for record in records:  # the last lines: counted, not acted on
            self._absorb(record)
        if self.probing:  # a probe the candidate won ends the stage: its outcome is the stage's switch
            self._note_last(records)
            self._read_probe()
        rate, rate_measured = self._current_rate()
        return StageOutcome(
            decision=self.decision,
            stop_reason=self.stop_reason,
            policy_state=self.policy_state,
            settings=self.settings,
            tracker=self.tracker,
            measured_tokens_per_s=rate,
            rate_measured=rate_measured,
            target_reached=self.target_reached,
        )


def log_not_carried_out(
    run_dir: Path, stage: int, request: SwitchRequest, last_iteration: int | None
) -> dict[str, Any]:
    """Append to ``decisions.jsonl`` that the stage's switch request came after its workers' last step
    boundary (they completed first), so it was not carried out; returns the record."""
    target = request.strategy.short() if request.strategy is not None else "?"
    record = {
        "stage": stage,
        "iteration": last_iteration,
        "decision": "not_carried_out",
        "requested": request.action,
        "strategy": strategy_dict(request.strategy) if request.strategy is not None else None,
        "reason": f"the {request.action} to {target} was requested after the stage's last step "
        f"(iteration {last_iteration}): not carried out",
    }
    record["time"] = record["decided_at"] = time.time()  # no metrics line: when the runner found it
    with open(run_dir / DECISIONS_NAME, "a") as handle:
        handle.write(json.dumps(record) + "\n")
    return record


def _time_of(record: MetricsRecord) -> float:
    """When the line was written (now, for a line without its time)."""
    return time.time() if record.time is None else record.time


def switch_request(decision: Decision, probe: ProbeAsk | None = None) -> SwitchRequest:
    """The request a switch, fall-back or probe decision writes for the workers."""
    target = decision.target
    assert target is not None, "a switch, fall-back or probe always names its target"
    return SwitchRequest(
        action=decision.action,
        reason=decision.reason,
        in_place=bool(decision.record.get("in_place")),
        strategy=target.strategy,
        predicted_tokens_per_s=target.predicted_tokens_per_s,
        throughput_source=target.throughput_source,
        fitted_on=target.fitted_on,
        on_first_line=target.on_first_line,
        probe=probe,
    )
