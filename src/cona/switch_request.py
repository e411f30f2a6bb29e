"""The switch request: what an online run's search asks a stage's workers to do at their next step boundary.

The runner writes it (``switch_request.json``, atomically) and reads it back when the stage ends; rank 0 of
the workers reads it at every step boundary. Its ``action``:

* ``stop``: the run's target is reached: save and end;
* ``switch`` / ``fallback``: end the stage for ``strategy``, handing the state over in place where
  ``in_place``, else through a checkpoint;
* ``probe``: train the next samples twice, at the current batch and at ``strategy``'s with ``probe``'s LR
  factors (:mod:`cona.engine.probe_branch`), and go on from the winner (a won probe ends the stage in place).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from cona.atomic_files import write_json_atomic
from cona.strategy import Strategy

Action = Literal["stop", "switch", "fallback", "probe"]
ACTIONS = ("stop", "switch", "fallback", "probe")


@dataclass(frozen=True, kw_only=True)
class ProbeAsk:
    """What a probe's candidate branch trains with and how its outcome is judged."""

    lr_factor: float
    """Peak LR of the candidate's branch over ``training.base_lr`` (its stage's, by the LR rule)."""
    min_lr_factor: float
    """Minimum LR over ``training.base_min_lr`` (likewise)."""
    samples: int
    """Samples each branch trains (rounded up by the workers to whole steps of both batches)."""
    tolerance: float
    """Probe-loss difference (nats) within which the branches count as equal."""


@dataclass(frozen=True, kw_only=True)
class SwitchRequest:
    action: Action
    reason: str
    in_place: bool = False
    """The workers keep their state for the next stage (a switch that keeps the layout, in a session)."""
    strategy: Strategy | None = None
    """The target of a switch, fallback or probe (None for a stop)."""
    predicted_tokens_per_s: float | None = None
    throughput_source: str = "predicted"
    """``predicted``, ``measured`` (the run trained it) or ``probed`` (a probe's branch measured it)."""
    fitted_on: int = 0
    on_first_line: bool = False
    probe: ProbeAsk | None = None
    """Set for ``probe``."""

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"unknown action {self.action!r}")
        targeted = self.strategy is not None
        if (self.action == "probe") != (self.probe is not None) or (self.action != "stop") != targeted:
            raise ValueError(f"a {self.action} request with strategy {self.strategy} and probe {self.probe}")

    def to_dict(self) -> dict[str, Any]:
        raw = dataclasses.asdict(self)
        return {key: value for key, value in raw.items() if value is not None}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SwitchRequest:
        """Refuses (ValueError) a record that is not a request."""
        try:
            values = dict(raw)
            if isinstance(values.get("strategy"), dict):
                values["strategy"] = Strategy(**values["strategy"])
            if isinstance(values.get("probe"), dict):
                values["probe"] = ProbeAsk(**values["probe"])
            return cls(**values)
        except (TypeError, AttributeError) as err:
            raise ValueError(f"not a switch request: {err}") from None

    def write(self, path: Path) -> Path:
        return write_json_atomic(path, self.to_dict())  # a worker never reads half of it

    @classmethod
    def read(cls, path: Path) -> SwitchRequest | None:
        """The request at ``path``; None where there is none or it cannot be read as one."""
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, ValueError):
            return None
