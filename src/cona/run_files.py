"""The run directory's layout: the name of every file CONA keeps under ``<log_root>/<run_name>/``.

The one owner of these names, so that the engine (which writes metrics, results and switch verdicts from
inside the workers), the runner (state, decisions, requests), the backends and the read-only views (status,
report, ``cona plan --trace``) agree on them. It imports nothing of CONA's, so every layer may import it::

    <log_root>/latest                              pointer to the newest run (runner/run_dir.py)
    <log_root>/<run_name>/metrics.jsonl            one line per log interval, rank 0 of every stage
                          decisions.jsonl          the online search's decisions
                          switch_request.json      the search's request, read by the workers
                          runner_state.json        the stage driver's saved progress (resume)
                          runner_end.json          how its newest runner left it (finished, stopped, failed)
                          online_stages.json       an online run's chosen stages
                          realized_chain.json      an online run as a chain file that replays it
                          fixed_chain.json         a fixed strategy's one-step chain (older versions)
                          wandb_run_id             the run's W&B id (wandb/: its files, by default)
                          mds_handover/            Megatron-DeepSpeed in-place switches: continue commands
                          stages/<N>/spec.json     what stage N runs (replay_spec.json: its replay)
                                     stage_result.json, plan.json, switch_check.json, switch_in.json,
                                     pids.json, torchrun.log, rank<r>.log, steps/rank<r>.jsonl

A checkpoint's own files (``trainer_state.json``, ``manifest.json``, ...) live in the checkpoint layout under
the workdir and belong to :mod:`cona.engine.checkpoint`.
"""

from __future__ import annotations

from pathlib import Path

LATEST = "latest"
"""Under ``log_root``: the newest run directory (a symlink, or a file naming it)."""
METRICS = "metrics.jsonl"
DECISIONS = "decisions.jsonl"
PROBES = "probes.jsonl"
"""One line per paired probe the workers ran (:mod:`cona.engine.probe_branch`): both branches' numbers."""
SWITCH_REQUEST = "switch_request.json"
RUNNER_STATE = "runner_state.json"
ONLINE_STAGES = "online_stages.json"
REALIZED_CHAIN = "realized_chain.json"
FIXED_CHAIN = "fixed_chain.json"
"""A fixed run's chain is built in memory; older cona versions kept it in this file, which marks their run
directories as fixed runs' (:func:`cona.runner.fixed.holds_fixed_run`)."""
RUNNER_END = "runner_end.json"
"""How the newest runner of the run left it (:mod:`cona.runner.run_end`)."""
WANDB_RUN_ID = "wandb_run_id"
"""The run's W&B id (one per run, kept by every resume; ``--fresh`` makes a new one)."""
STAGES = "stages"

SPEC = "spec.json"
REPLAY_SPEC = "replay_spec.json"
REPLAY_RESULT = "replay_result.json"
STAGE_RESULT = "stage_result.json"
STAGE_PLAN = "plan.json"
SWITCH_CHECK = "switch_check.json"
SWITCH_IN = "switch_in.json"
"""``stages/<N>/``: the start milestones of the stage's first attempt (what the switch into it cost)."""
PIDS = "pids.json"
TORCHRUN_LOG = "torchrun.log"
"""Node 0's; node ``k`` of a run across nodes writes ``torchrun.node<k>.log`` (:func:`torchrun_log_name`)."""
PIDS_GLOB = "pids*.json"
"""Every node's pids record."""
SESSION_PREFIX = "session-"
"""``<run_dir>/session-<n>/``: the markers through which the runner hands a worker session its next stage."""
STEP_TRACE_DIR = "steps"
MDS_HANDOVER = "mds_handover"
"""``<run_dir>/mds_handover/continue-<N>.json``: the runner's command to Megatron-DeepSpeed processes that
handed a stage over in place at iteration N (``cona.backends.megatron_deepspeed.handover``)."""

FRESH_FILES = (
    RUNNER_STATE,
    RUNNER_END,
    METRICS,
    SWITCH_REQUEST,
    DECISIONS,
    PROBES,
    ONLINE_STAGES,
    REALIZED_CHAIN,
    WANDB_RUN_ID,
)
"""What ``--fresh`` removes from a run directory of any mode, besides ``stages/``."""


def rank_log_name(rank: int) -> str:
    """``rank<r>.log``: the worker's stdout and stderr."""
    return f"rank{rank}.log"


def rank_error_name(rank: int) -> str:
    """``rank<r>.error``: the exception a worker failed with (JSON)."""
    return f"rank{rank}.error"


RANK_ERROR_GLOB = "rank*.error"


def torchrun_log_name(node_rank: int) -> str:
    return TORCHRUN_LOG if node_rank == 0 else f"torchrun.node{node_rank}.log"


def pids_name(node_rank: int) -> str:
    """Who runs the stage on node ``node_rank`` (host, runner and torchrun pids, start and end)."""
    return PIDS if node_rank == 0 else f"pids.node{node_rank}.json"


def metrics_path(run_dir: Path) -> Path:
    return Path(run_dir) / METRICS


def decisions_path(run_dir: Path) -> Path:
    return Path(run_dir) / DECISIONS


def probes_path(run_dir: Path) -> Path:
    return Path(run_dir) / PROBES


def switch_request_path(run_dir: Path) -> Path:
    return Path(run_dir) / SWITCH_REQUEST


def runner_state_path(run_dir: Path) -> Path:
    return Path(run_dir) / RUNNER_STATE


def runner_end_path(run_dir: Path) -> Path:
    return Path(run_dir) / RUNNER_END


def stages_path(run_dir: Path) -> Path:
    """``<run_dir>/stages``, which holds one directory per stage number."""
    return Path(run_dir) / STAGES


def stage_path(run_dir: Path, stage: int) -> Path:
    """``<run_dir>/stages/<stage>`` (not created; :func:`cona.runner.run_dir.stage_dir` creates it)."""
    return stages_path(run_dir) / str(stage)


def spec_path(run_dir: Path, stage: int) -> Path:
    return stage_path(run_dir, stage) / SPEC


def stage_result_path(run_dir: Path, stage: int) -> Path:
    return stage_path(run_dir, stage) / STAGE_RESULT


def stage_plan_path(run_dir: Path, stage: int) -> Path:
    return stage_path(run_dir, stage) / STAGE_PLAN
