"""What an online run's policy remembers from one stage to the next, and how it is rebuilt after a resume.

Between stages of one runner process the search hands its outcome to the next stage's search; after a kill,
the same memory is rebuilt from the run directory: the noise-scale tracker from ``metrics.jsonl``, the
measured switch costs from the run state (in-place switches apart from those through a checkpoint, as the
policy keeps them), the earlier stages' measured throughputs (the fallback targets) and the probes the
candidates lost (``probes.jsonl``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from cona import run_files
from cona.engine.checkpoint.info import read_checkpoint_info
from cona.errors import CheckpointError
from cona.jsonl import read_lines
from cona.planner.efficiency import NoiseScaleTracker
from cona.planner.policy import FinishedStage, PolicySettings, PolicyState, initial_state
from cona.planner.policy_probe import after_lost_probe
from cona.planner.probe_rule import ProbeOutcome
from cona.runner.noise_history import noise_tracker
from cona.runner.run_descriptions import OnlineRun
from cona.runner.schedules.online_search import PendingSwitch
from cona.runner.schedules.online_stages import StageRecords
from cona.runner.state import RunState
from cona.runner.views.online_report import stage_rows


@dataclass
class Memory:
    """What carries from one stage's search to the next."""

    settings: PolicySettings
    policy_state: PolicyState
    tracker: NoiseScaleTracker
    pending: PendingSwitch | None = None


def resumed_memory(
    run: OnlineRun, state: RunState, records: StageRecords, *, in_place: bool, in_place_mbs: bool = True
) -> Memory:
    """The memory at the start of the current stage of ``state``, from the run directory's files."""
    training = run.config.training
    current = state.current
    assert current is not None
    tracker = noise_tracker(run.run_dir, training.lr.base_gbs, current.start_iteration or 0)
    policy_state = _with_switch_costs(initial_state(records.candidate(len(state.stages))), state, records)
    earlier = len(state.stages) - 1
    if earlier:
        rates = stage_rows(run.run_dir, state, records.entries)[:earlier]
        policy_state = dataclasses.replace(policy_state, earlier=_earlier_stages(rates, records))
    policy_state = lost_probes(run.run_dir, policy_state, seq=run.config.model.seq)
    # Probes need the native engine's workers: another backend switches on the noise-scale model alone.
    probe = training.online.probe and run.backend == "native"
    overrides = {"in_place": in_place, "in_place_mbs": in_place_mbs, "probe": probe, **run.policy_overrides}
    settings = PolicySettings.from_training(training, max_gbs=run.max_gbs, **overrides)
    return Memory(settings=settings, policy_state=policy_state, tracker=tracker)


def lost_probes(run_dir: Path, state: PolicyState, *, seq: int) -> PolicyState:
    """The policy's memory of the probes its candidates lost (``probes.jsonl``), as the killed run had it
    (the noise scale then is not recorded: only the tokens space the next probe)."""
    for line in read_lines(run_files.probes_path(run_dir)):
        record = line.value
        if not isinstance(record, dict) or "skipped" in record or record.get("winner") != "current":
            continue
        outcome = ProbeOutcome.from_dict(record)
        state = after_lost_probe(state, outcome, outcome.consumed_samples * seq, None)
    return state


def _earlier_stages(rates: list[dict], records: StageRecords) -> tuple[FinishedStage, ...]:
    """The stages the policy remembers, as :func:`after_switch` left them in the run that was killed: each
    stage left for a larger batch is kept; a fall-back drops the stage it returns to (it is current
    again), and the stage it left is not kept."""
    earlier: tuple[FinishedStage, ...] = ()
    for row in rates:
        left, entered = records.strategy(row["stage"]), records.strategy(row["stage"] + 1)
        if entered.gbs < left.gbs:
            earlier = earlier[:-1]
            continue
        candidate = records.candidate(row["stage"])
        finished = FinishedStage(  # a stage without a steady line: the rate it was chosen on, as in-process
            strategy=left,
            measured_tokens_per_s=row["tokens_per_s"] or candidate.predicted_tokens_per_s,
            rate_measured=row["tokens_per_s"] is not None,
        )
        earlier = (*earlier, finished)
    return earlier


def _with_switch_costs(policy_state: PolicyState, state: RunState, records: StageRecords) -> PolicyState:
    """The mean measured cost of the switches so far, in place and through a checkpoint apart."""
    costs: dict[bool, list[float]] = {True: [], False: []}
    for stage in state.stages:
        if stage.switch_cost:
            costs[records.continues_in_place(stage.step_num)].append(sum(stage.switch_cost.values()))
    if costs[False]:
        mean = sum(costs[False]) / len(costs[False])
        policy_state = dataclasses.replace(
            policy_state, measured_switch_cost_s=mean, switches=len(costs[False])
        )
    if costs[True]:
        mean = sum(costs[True]) / len(costs[True])
        policy_state = dataclasses.replace(
            policy_state, measured_in_place_cost_s=mean, in_place_switches=len(costs[True])
        )
    return policy_state


def tracker_at_resume(
    run: OnlineRun, memory: Memory, stage: int, load_path: Path | None
) -> NoiseScaleTracker:
    """The noise-scale tracker a stage's attempt starts its search with: the memory's, or, when the attempt
    resumes from a checkpoint the stage itself saved (periodic, or a relaunch), rebuilt from metrics.jsonl
    up to that checkpoint's iteration, so the search sees each of the stage's lines once, as an
    uninterrupted stage would."""
    if load_path is None:
        return memory.tracker
    try:
        saved = read_checkpoint_info(load_path).trainer_state
    except CheckpointError:
        return memory.tracker
    if saved.get("stage") != stage or not isinstance(saved.get("iteration"), int):
        return memory.tracker
    return noise_tracker(run.run_dir, run.config.training.lr.base_gbs, saved["iteration"])
