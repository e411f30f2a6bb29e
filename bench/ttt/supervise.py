"""Running one configuration of the time-to-target benchmark: launch ``cona train``, watch its
``metrics.jsonl``, stop it at the target (fixed and ramp runs have no perplexity stop of their own), at its
time cap or when it stops improving, and take it down if it outlives the grace after a stop."""

from __future__ import annotations

import json
import math
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROJECT_ROOT = Path(__file__).resolve().parents[2]
STOP_GRACE_S = 45.0
"""After a stop request, how long the run may take to save and exit before it is terminated."""
TERM_GRACE_S = 15.0
POLL_S = 0.5


@dataclass(frozen=True, kw_only=True)
class RunPlan:
    name: str
    kind: str
    """``online``, ``fixed`` or ``ramp`` (a predefined chain)."""
    command: list[str]
    root: Path
    run_dir: Path
    cap_s: float


@dataclass(frozen=True, kw_only=True)
class Supervised:
    launched_at: float
    ended_at: float
    exit_code: int | None
    stop: str
    """Why it ended: target, stopped itself, cap, no improvement, exited, terminated."""


def request_stop(run_dir: Path, reason: str) -> None:
    """The switch-request file with action ``stop`` (atomically): workers save at the next step and exit."""
    # A cap can fall before the runner made the directory; the runner then deletes the request when it
    # launches the stage, and the run ends by termination after the grace.
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / ".switch_request.json.tmp"
    tmp.write_text(json.dumps({"action": "stop", "reason": reason}) + "\n")
    os.replace(tmp, run_dir / "switch_request.json")


@dataclass(kw_only=True)
class StopRule:
    """When this script stops a run: a fixed run at the first evaluation at or below the target (an online
    run stops itself there); any run at its time cap, or after ``patience`` evaluations without a new best
    perplexity (on this small corpus a run that starts to overfit before the target never reaches it)."""

    plan: RunPlan
    target_ppl: float
    patience: int
    cap_s: float
    launched: float
    trained: bool = False
    """Whether a metrics line was seen (the first one is printed as the end of the start-up)."""
    best: float = math.inf
    since_best: int = 0
    reason: str | None = None
    requested_at: float | None = None
    requested_in_stage: Any = None
    """The stage that was training when this script asked for the stop (None: not asked)."""
    stage: Any = None

    def see(self, record: dict[str, Any]) -> None:
        self.stage = record.get("stage", self.stage)
        if self.requested_in_stage is not None and self.stage != self.requested_in_stage:
            # The chain runner clears the request file when it launches a stage, so a stop asked for at
            # a stage boundary (the ramp's) is lost: ask the new stage again.
            self.requested_in_stage = self.stage
            request_stop(self.plan.run_dir, self.reason or "stop")
        if not self.trained and "step_time_s" in record:
            self.trained = True
            print(
                f"  [{self.plan.name}] first steps done {record['time'] - self.launched:.1f} s after launch"
            )
        ppl = record.get("eval_ppl")
        if ppl is None:
            return
        print(
            f"  [{self.plan.name}] {record['time'] - self.launched:7.1f} s  it {record['iteration']:5d}  "
            f"{record['consumed_tokens']:>11,} tok  gbs {record['gbs']:4d}  eval ppl {ppl:9.1f}",
            flush=True,
        )
        self.best, self.since_best = (ppl, 0) if ppl < self.best else (self.best, self.since_best + 1)
        if self.reason is not None:
            return
        if ppl <= self.target_ppl:
            online = self.plan.kind == "online"
            self._stop("stopped itself" if online else "target", request=not online)
        elif self.since_best >= self.patience:
            self._stop(f"no improvement in {self.patience} evals")

    def overdue(self, now: float) -> bool:
        """Whether the run should be terminated: it did not exit within the grace after the stop."""
        if self.reason is None and now - self.launched > self.cap_s:
            self._stop(f"cap {self.cap_s:.0f} s")
        return self.requested_at is not None and now - self.requested_at > STOP_GRACE_S

    def _stop(self, reason: str, *, request: bool = True) -> None:
        self.reason, self.requested_at = reason, time.time()
        if request:
            self.requested_in_stage = self.stage if self.stage is not None else "unknown"
            request_stop(self.plan.run_dir, reason)


def supervise(plan: RunPlan, *, target_ppl: float, patience: int, cap_s: float) -> Supervised:
    """Run one configuration under its :class:`StopRule`, printing its evaluations as they come."""
    import subprocess

    from cona.jsonl import JsonlTail

    paths = [str(PROJECT_ROOT / "src"), os.environ.get("PYTHONPATH")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths))}
    # A fresh compile cache per run: no run may reuse kernels an earlier run compiled.
    env["TORCHINDUCTOR_CACHE_DIR"] = str(plan.root / "inductor-cache")
    env["TRITON_CACHE_DIR"] = str(plan.root / "triton-cache")
    tail = JsonlTail(plan.run_dir / "metrics.jsonl")
    with open(plan.root / "cona.log", "w") as log:
        launched = time.time()
        process = subprocess.Popen(
            plan.command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        rule = StopRule(plan=plan, target_ppl=target_ppl, patience=patience, cap_s=cap_s, launched=launched)
        try:
            while process.poll() is None:
                time.sleep(POLL_S)
                for record in tail.new_records():
                    rule.see(record)
                if rule.overdue(time.time()):
                    rule.reason = f"{rule.reason}; terminated"
                    _terminate(process)
        finally:  # this script interrupted or killed by its time limit: take the run down with it
            if process.poll() is None:
                _terminate(process)
    for record in tail.new_records():
        rule.see(record)
    return Supervised(
        launched_at=launched, ended_at=time.time(), exit_code=process.returncode, stop=rule.reason or "exited"
    )


def _terminate(process: Any) -> None:
    """SIGTERM to the run's process group (cona and torchrun, which stops its workers), then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        if _group_exits(process, TERM_GRACE_S):
            break
    process.wait()


def _group_exits(process: Any, wait_s: float) -> bool:
    deadline = time.time() + wait_s
    while time.time() < deadline:
        process.poll()  # reaps the leader: a zombie would keep its group alive
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(POLL_S)
    return False
