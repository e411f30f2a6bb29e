"""In-place switches through a real Megatron-DeepSpeed checkout (CPU, 2 ranks; the set-up, data and skip
rules of :mod:`test_megatron_deepspeed_integration`, whose helpers these tests share).

- a chain whose gbs-only step continues the previous step's processes (``--switch-in-place``) against the
  same chain through checkpoints: the same books, consumed counts, LR, losses and final evaluations;
- an online run whose gbs switch keeps the layout: done in place, and its realized chain replays through
  checkpoints to the same books and losses.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
from tests.backends.test_megatron_deepspeed_integration import (  # noqa: F401 (pytestmark: its skips)
    CHAIN,
    ONLINE_ITERS,
    _checks,
    _online_run,
    _records,
    _replay,
    _setup,
    demo_data,
    pytestmark,
)

from cona.backends.megatron_deepspeed.environment import MdsEnvironment, qkv_layout, resolve_environment
from cona.backends.megatron_deepspeed.log_parse import Evaluation, parse_evaluation_line
from cona.backends.megatron_deepspeed.run import run_mds_chain, run_mds_online
from cona.commands.train_runs import chain_run as chain_run_from_args
from cona.planner.plan import space_options
from cona.strategy import Strategy


@pytest.fixture(scope="module")
def env() -> MdsEnvironment:
    return resolve_environment(None, None, None, os.environ)


@pytest.fixture(scope="module")
def data_prefix(tmp_path_factory) -> Path:
    return demo_data(tmp_path_factory.mktemp("mds-data"))


PP2 = {"dp": 1, "tp": 1, "pp": 2}


def gbs_chain(env: MdsEnvironment) -> list[dict]:
    """gbs 4 -> 8 on one layout (in place), then a step through the checkpoint: an mbs change where the
    checkout runs micro-batches > 1 (per-head QKV), else (blocked QKV: mbs 1 only, no tp change) pp 2 ->
    dp 2 through the universal copy."""
    last = {"step_num": 3, "gbs": 4, "extra_iters": 2}
    if qkv_layout(env.repo) == "blocked":
        convert, last = {"convert": True}, {**last, "dp": 2, "tp": 1, "pp": 1, "mbs": 1}
    else:
        convert, last = {}, {**last, **PP2, "mbs": 2}
    return [
        {"step_num": 1, **PP2, "gbs": 4, "mbs": 1, "train_iters": 4, "is_initial": True},
        {"step_num": 2, **PP2, "gbs": 8, "mbs": 1, "extra_iters": 3, **convert},
        last,
    ]


def test_a_gbs_only_step_switches_in_place_with_the_losses_of_the_checkpointed_switch(
    env, data_prefix, tmp_path
):
    """``--switch-in-place``: step 2 (gbs 4 -> 8 on the same layout) continues step 1's processes, step 3
    (an mbs or layout change, :func:`gbs_chain`) goes through the checkpoint; the same chain without in-place
    switches gives the same books and, iteration by iteration, the same samples (consumed counts), LR and
    losses (the pipeline engine of pp 2 takes the new number of micro-batches in process). Every gbs-8 step
    trains at the gbs-8 rule's LR in both (the relaunch's optimizer state, which restores the gbs-4 one, is
    overridden)."""
    args = _setup(tmp_path, data_prefix, gbs_chain(env), lr_decay_tokens=4000)
    args.switch_in_place, args.run_name = True, "in-place"
    in_place = run_mds_chain(chain_run_from_args(args), env)
    args.switch_in_place, args.run_name = False, "checkpointed"
    checkpointed = run_mds_chain(chain_run_from_args(args), env)

    runs = {"in-place": in_place, "checkpointed": checkpointed}
    books = {name: [(s.last_iteration, s.consumed_samples, s.consumed_tokens) for s in state.stages]
             for name, state in runs.items()}  # fmt: skip
    assert books["in-place"] == books["checkpointed"] == [(4, 16, 1024), (7, 40, 2560), (9, 48, 3072)]
    assert [s.checkpoint is None for s in in_place.stages] == [True, False, False]  # handed over, then saved
    assert all(s.checkpoint is not None for s in checkpointed.stages)
    stage_two = tmp_path / "logs" / "in-place" / "stages" / "2"
    assert json.loads((stage_two / "continue.json").read_text())["gbs"] == 8
    assert not (stage_two / "ds_config.json").exists()  # no launch of its own
    records = {name: _records(tmp_path / "logs" / name) for name in runs}
    for name in runs:
        assert [r["iteration"] for r in records[name]] == list(range(1, 10))
        assert [r["gbs"] for r in records[name]] == [4] * 4 + [8] * 3 + [4] * 2
    counts = {name: [(r["consumed_samples"], r["consumed_tokens"]) for r in records[name]] for name in runs}
    assert counts["in-place"] == counts["checkpointed"]
    for key in ("loss", "lr"):
        values = {name: [r[key] for r in records[name]] for name in runs}
        assert values["in-place"] == pytest.approx(values["checkpointed"], rel=1e-5), key
    lrs = [r["lr"] for r in records["in-place"]]
    assert lrs[4] > lrs[3] and len(set(lrs[4:7])) == 3  # the gbs-8 rule's (scaled up), not a constant
    # Step 2's final evaluations (after its save) draw 2 x gbs 8 samples: from the datasets built again at the
    # in-place switch, as the relaunch at gbs 8 builds them (Megatron's own, sized at gbs 4, run out).
    draws = {name: _final_draws(tmp_path / "logs" / name / "stages" / "2" / "megatron.log") for name in runs}
    assert [(e.split, e.samples) for e in draws["in-place"]] == [("validation", 16), ("test", 16)]
    assert [e.loss for e in draws["in-place"]] == pytest.approx([e.loss for e in draws["checkpointed"]])


def test_an_online_gbs_switch_in_place_replays_through_checkpoints_to_the_same_losses(
    env, data_prefix, tmp_path, monkeypatch
):
    """The same online run with the frontier held to mbs 1, so that its gbs-8 strategy keeps dp, tp, pp and
    mbs: the switch is done in place (no checkpoint, no conversion, no verification), and
    ``realized_chain.json`` replays through checkpoints and ds_to_universal to the same books and losses."""
    if qkv_layout(env.repo) == "blocked":
        pytest.skip("online mode is refused on a blocked-QKV checkout (covered by the CLI tests)")
    monkeypatch.setattr(
        "cona.runner.schedules.frontier.space_options",
        lambda training: dataclasses.replace(space_options(training), max_mbs=1),
    )
    args = _setup(tmp_path, data_prefix, CHAIN, lr_decay_tokens=20_000)
    # The in-place switch's cost assumed until one is measured (1 s) is a third of this short run's rest.
    run = _online_run(args, tmp_path, predicted_in_place_cost_s=0.0)
    state = run_mds_online(run, env, out=lambda line: None)

    entries = json.loads((run.run_dir / "online_stages.json").read_text())
    assert len(state.stages) >= 2 and state.stages[-1].last_iteration == ONLINE_ITERS
    assert entries[1]["in_place"] and state.stages[0].checkpoint is None and not _checks(run.run_dir)
    assert Strategy(**entries[1]["strategy"]).same_layout(Strategy(**entries[0]["strategy"]), keep_mbs=True)
    records = _records(run.run_dir)
    assert [r["iteration"] for r in records] == list(range(1, ONLINE_ITERS + 1))
    replay_losses = _replay(args, run, state, env)
    # The replay's switch loads a universal copy, 1e-5 relative from the in-place switch here (1.2e-5 at most
    # in a run); through Megatron's own checkpoint (the chain test below) the two agree to the log's digits.
    assert replay_losses == pytest.approx({r["iteration"]: r["loss"] for r in records}, rel=3e-5)


def _final_draws(log: Path) -> list[Evaluation]:
    evaluations = map(parse_evaluation_line, log.read_text(errors="replace").splitlines())
    return [e for e in evaluations if e is not None and e.samples is not None]
