"""A Megatron-DeepSpeed launch's output: followed line by line, with the times of its parts and its failure.

The launcher's whole output goes to the stage's log as it comes and, line by line, to the metrics
recorder (:mod:`.log_parse`). A launch ends when its processes exit, or when its stage hands over in place
(the hooks' ``cona handover`` line): its processes then wait, and the rest of their output is the next
stage's (:mod:`.handover`).
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from cona.backends.megatron_deepspeed.log_parse import parse_handover_line
from cona.backends.megatron_deepspeed.nodes import LastRankView

# Lines of Megatron's start-up and exit that date the switch's parts (the first match of each counts).
TIMING_LINES = {
    "process_start": "using world size:",
    "load_done": "[after model, optimizer, and learning rate scheduler are built]",
    "setup_done": "done with setup ...",
    "first_step_done": "| consumed samples:",
    "train_done": "after training is done",
    "save_done": "successfully saved checkpoint at iteration",
    # Megatron evaluates its final draws after it saved (so this is not the native "probe_done", which
    # precedes
    # the save): the cost of the "before" side of switch verification is final_eval_done - save_done.
    "final_eval_done": "-sample draw from test set",
}
_ERROR_LINE = re.compile(r"(Error|Exception|error:)")


@dataclass(frozen=True, kw_only=True)
class LaunchOutput:
    returncode: int
    handed_over: bool
    """The stage handed its state over in place: its processes wait for the next stage."""
    timings: dict[str, float]
    view: LastRankView
    """What the last rank printed (on another node: that node's launcher shared it)."""
    log: Path
    seconds: float


def follow(
    process: subprocess.Popen,
    log: IO[str],
    feed: Callable[[str], None],
    timings: dict[str, float],
    markers: Mapping[str, str],
) -> tuple[int | None, int | None]:
    """Copy the process's output to ``log`` and ``feed`` line by line until it exits (``(return code,
    None)``) or its stage hands over (``(None, iteration)``: it waits for a continue command, and the rest
    of its output is the next stage's). ``markers``: ``{key: text}``; the time each text first appears goes
    to ``timings``."""
    assert process.stdout is not None
    for line in process.stdout:
        log.write(line)
        now = time.time()
        for key, marker in markers.items():
            if key not in timings and marker in line:
                timings[key] = now
        feed(line)
        handover = parse_handover_line(line)
        if handover is not None:
            return None, handover
    return process.wait(), None


def span_s(timings: dict[str, float], start: str, end: str) -> float:
    """Seconds from the ``start`` line to the ``end`` line (0 when either was not seen)."""
    began, finished = timings.get(start), timings.get(end)
    return finished - began if began is not None and finished is not None else 0.0


def failure_text(output: LaunchOutput) -> str:
    """The launch's exit code and its last error line (the log has the rest)."""
    lines = output.log.read_text(errors="replace").splitlines() if output.log.is_file() else []
    errors = [line.strip() for line in lines if _ERROR_LINE.search(line)]
    detail = errors[-1] if errors else (lines[-1].strip() if lines else "no output")
    return f"exit {output.returncode}: {detail[:300]} (log {output.log})"
