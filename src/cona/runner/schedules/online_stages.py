"""``online_stages.json``: the strategies an online run chose, one record per stage, and why.

The run state (:mod:`cona.runner.state`) says where each stage stands; these records say what each stage is:
its strategy, the throughput expected of it and where that number came from, the decision that chose it,
and whether the switch into it kept the state in the workers' memory (in place). Written atomically after
every change, read back on a resume.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from cona import run_files
from cona.atomic_files import write_json_atomic
from cona.planner.policy import Candidate
from cona.strategy import Strategy


class StageRecords:
    """The records of one run directory (``entries``: the JSON list, oldest stage first)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / run_files.ONLINE_STAGES
        self.entries: list[dict[str, Any]] = []

    def load(self) -> None:
        self.entries = json.loads(self.path.read_text())

    def add(self, candidate: Candidate, *, action: str, reason: str, in_place: bool = False) -> None:
        self.entries.append(
            {
                "strategy": dataclasses.asdict(candidate.strategy),
                "predicted_tokens_per_s": candidate.predicted_tokens_per_s,
                "throughput_source": candidate.throughput_source,
                "fitted_on": candidate.fitted_on,
                "trial": candidate.trial,
                "action": action,
                "reason": reason,
                "in_place": in_place,
            }
        )
        write_json_atomic(self.path, self.entries)

    def strategy(self, step_num: int) -> Strategy:
        return Strategy(**self.entries[step_num - 1]["strategy"])

    def candidate(self, step_num: int) -> Candidate:
        entry = self.entries[step_num - 1]
        return Candidate(
            strategy=self.strategy(step_num),
            predicted_tokens_per_s=entry["predicted_tokens_per_s"],
            throughput_source=entry.get("throughput_source", "predicted"),
            fitted_on=entry.get("fitted_on", 0),
            trial=entry.get("trial", False),
        )

    def continues_in_place(self, step_num: int) -> bool:
        """Whether the switch into stage ``step_num`` kept the state in the workers' memory."""
        return step_num > 1 and bool(self.entries[step_num - 1].get("in_place"))
