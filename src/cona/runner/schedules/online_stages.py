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
from cona.errors import ChainError
from cona.jsonl import read_json
from cona.planner.policy import Candidate
from cona.runner.state import START_OVER
from cona.strategy import Strategy


class StageRecords:
    """The records of one run directory (``entries``: the JSON list, oldest stage first)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / run_files.ONLINE_STAGES
        self.entries: list[dict[str, Any]] = []

    def load(self, stages: int) -> None:
        """Read the records of a run whose state holds ``stages`` stages; a damaged file is refused naming
        it. Each record is written before the state that adds its stage, so there are at least as many; one
        more is a switch killed between the two writes, which the resumed run requests and records again, so
        it is dropped (kept, it would stand where that new record should, and the stage after it would train
        the strategy before)."""
        try:
            entries = read_json(self.path)
            if not isinstance(entries, list):
                raise TypeError("not a JSON list")
            for entry in entries:
                Strategy(**entry["strategy"])
        except FileNotFoundError:
            entries = []
        except (json.JSONDecodeError, TypeError, KeyError) as err:
            raise ChainError(f"{self.path}: damaged stage records ({err}); {START_OVER}") from None
        if len(entries) < stages:
            raise ChainError(f"{self.path}: {len(entries)} stage records for {stages} stages; {START_OVER}")
        self.entries = entries[:stages]

    def add(self, candidate: Candidate, *, action: str, reason: str, in_place: bool = False) -> None:
        self.entries.append(
            {
                "strategy": dataclasses.asdict(candidate.strategy),
                "predicted_tokens_per_s": candidate.predicted_tokens_per_s,
                "throughput_source": candidate.throughput_source,
                "fitted_on": candidate.fitted_on,
                "on_first_line": candidate.on_first_line,
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
            on_first_line=entry.get("on_first_line", False),
        )

    def continues_in_place(self, step_num: int) -> bool:
        """Whether the switch into stage ``step_num`` kept the state in the workers' memory."""
        return step_num > 1 and bool(self.entries[step_num - 1].get("in_place"))
