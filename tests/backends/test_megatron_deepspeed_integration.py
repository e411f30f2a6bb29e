"""Real Megatron-DeepSpeed runs through CONA's backend (CPU, 2 ranks, 2 layers, hidden 64, seq 64).

They run only when ``CONA_MEGATRON_DEEPSPEED`` names a checkout and ``CONA_MEGATRON_DEEPSPEED_PYTHON`` its
interpreter (``CONA_MEGATRON_DEEPSPEED_SHIM``: the torchvision stub; ``scripts/setup_megatron_deepspeed.sh``
makes both), and need the demo corpus and GPT-2 tokenizer files of ``data/demo`` (``scripts/install.sh``).
What they expect depends on the checkout's fused-QKV layout (:func:`qkv_layout`):

- per-head (6acc370a and earlier): the chain tp1/pp2 -> tp2/pp1 -> tp1/pp1/dp2 passes switch verification at
  both switches; without the cat_dim repair the tp1 -> tp2 switch is refused.
- blocked (676a482c and later, e.g. HEAD f4157bea): the same chain is refused before anything runs; with that
  check off, verification refuses the tp1 -> tp2 switch although the cat_dim repair ran.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tests.helpers.torchrun_util import free_port_block

from cona.backends.megatron_deepspeed.commands import (
    CheckpointLoad,
    StageArgs,
    chain_shape,
    pretrain_args,
)
from cona.backends.megatron_deepspeed.environment import (
    PYTHON_ENV,
    REPO_ENV,
    MdsEnvironment,
    qkv_layout,
    resolve_environment,
)
from cona.backends.megatron_deepspeed.run import run_mds_chain, run_mds_online
from cona.commands.train_runs import chain_run as chain_run_from_args
from cona.config.file import load_config
from cona.data.preprocess import PreprocessOptions, preprocess
from cona.engine.optim import lr_schedule
from cona.errors import ChainError, CheckpointError
from cona.runner.run_descriptions import OnlineRun
from cona.runner.run_dir import resolve_log_root
from cona.runner.state import RunState, load_state
from cona.strategy import Strategy

ROOT = Path(__file__).resolve().parents[2]
VOCAB, MERGES = ROOT / "data" / "demo" / "gpt2-vocab.json", ROOT / "data" / "demo" / "gpt2-merges.txt"
CORPUS = ROOT / "data" / "demo" / "wiki.jsonl"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (os.environ.get(REPO_ENV) and os.environ.get(PYTHON_ENV)),
        reason=f"{REPO_ENV} and {PYTHON_ENV} do not name a Megatron-DeepSpeed checkout and its Python",
    ),
    pytest.mark.skipif(
        not (VOCAB.is_file() and MERGES.is_file()), reason="no data/demo GPT-2 tokenizer files"
    ),
]
STEP = {"gbs": 4, "mbs": 1, "convert": True}
CHAIN = [
    {"step_num": 1, "dp": 1, "tp": 1, "pp": 2, **STEP, "train_iters": 4, "is_initial": True},
    {"step_num": 2, "dp": 1, "tp": 2, "pp": 1, **STEP, "extra_iters": 4},
    {"step_num": 3, "dp": 2, "tp": 1, "pp": 1, "gbs": 8, "mbs": 1, "extra_iters": 4},
]


@pytest.fixture(scope="module")
def env() -> MdsEnvironment:
    return resolve_environment(None, None, None, os.environ)


@pytest.fixture(scope="module")
def data_prefix(tmp_path_factory) -> Path:
    return demo_data(tmp_path_factory.mktemp("mds-data"))


def demo_data(directory: Path) -> Path:
    """The first 300 articles of the demo corpus, through ``cona preprocess`` (Megatron's mmap format; the
    checkout's own tools/preprocess_data.py leaves each document's EOD out of its size with --append-eod,
    which CONA's reader refuses). Real text matters: on random words a model this small and this briefly
    trained barely uses its attention, and a scrambled QKV then moved the loss of the draw by only 1.2e-4
    (tolerance 2.2e-4) in a run here."""
    with open(CORPUS) as source, open(directory / "docs.jsonl", "w") as target:
        target.writelines(line for _, line in zip(range(300), source, strict=False))
    options = PreprocessOptions(
        input=directory / "docs.jsonl",
        output_prefix=str(directory / "docs"),
        vocab_file=VOCAB,
        merge_file=MERGES,
        append_eod=True,
    )
    preprocess(options, show_progress=False)
    return directory / "docs_text_document"


def _setup(directory: Path, data_prefix: Path, steps: list[dict], **training_keys) -> argparse.Namespace:
    model = {"name": "gpt-mds", "layers": 2, "hidden": 64, "heads": 4, "seq": 64, "normalization": "rmsnorm"}
    training = {"device": "cpu", "zero_stage": 1, "dtype": "fp32", "base_gbs": 4, "base_lr": 5e-3}
    training.update(base_min_lr=5e-4, lr_warmup_tokens=256, split="90,8,2", data_prefix=str(data_prefix))
    training.update(vocab_file=str(VOCAB), merge_file=str(MERGES), log_interval=1, eval_interval=100)
    training.update(eval_iters=2, log_root=str(directory / "logs"), **training_keys)
    config = {"model": {**model, "attention_dropout": 0.0, "hidden_dropout": 0.0}, "training": training}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / ".conaconfig").write_text(json.dumps(config))
    (directory / "chain.json").write_text(json.dumps({"steps": steps}))
    return argparse.Namespace(
        chain=str(directory / "chain.json"),
        config=str(directory / ".conaconfig"),
        gpus=2,
        workdir=str(directory / "work"),
        run_name="it",
        master_port_base=_free_port_base(),
        quiet=True,
    )


def _free_port_base(stages: int = len(CHAIN)) -> int:
    """A base whose stage ports (base + 1 ...) are free now (other test runs may be launching)."""
    return free_port_block(stages + 1)


def test_every_generated_flag_exists_in_the_checkout(env, tmp_path):
    config = load_config(_setup(tmp_path, tmp_path / "d", CHAIN).config, check_data_files=False)
    strategies = [Strategy(dp=s["dp"], tp=s["tp"], pp=s["pp"], mbs=s["mbs"], gbs=s["gbs"]) for s in CHAIN]
    shape = chain_shape(config, zip(strategies, (4, 8, 12), strict=True))
    load = CheckpointLoad.from_path(tmp_path / "global_step4_universal")
    base = {
        "ds_config_path": tmp_path / "ds.json",
        "schedule": lr_schedule(config.training, planned_tokens=4096),
    }
    launches = [
        StageArgs(**base, stop_tokens=1024, save_dir=tmp_path, load=None, override_scheduler=False,
                  device_type="cpu", run_name="r"),
        StageArgs(**base, stop_tokens=None, save_dir=None, load=load, override_scheduler=True,
                  device_type="cuda", run_name="r", skip_train=True),
    ]  # fmt: skip
    source = (env.repo / "megatron" / "arguments.py").read_text()
    # Megatron's parser also takes DeepSpeed's own arguments (deepspeed.add_config_arguments).
    listing = "import argparse, deepspeed; p = deepspeed.add_config_arguments(argparse.ArgumentParser()); "
    listing += "print(*[o for a in p._actions for o in a.option_strings])"
    process_env = env.process_env(os.environ, device_type="cpu")
    listed = subprocess.run(
        [str(env.python), "-c", listing], env=process_env, capture_output=True, text=True, check=True
    )
    deepspeed_flags = listed.stdout.split()
    for args in launches:
        flags = [arg for arg in pretrain_args(config, strategies[1], shape, args) if arg.startswith("--")]
        for flag in flags:
            known = f"'{flag}'" in source or f'"{flag}"' in source or flag in deepspeed_flags
            assert known, f"{flag} is not an argument of {env.repo}"


def _checks(run_dir: Path) -> dict[int, dict]:
    state = json.loads((run_dir / "runner_state.json").read_text())
    return {stage["step_num"]: stage["switch_check"] for stage in state["stages"] if stage["switch_check"]}


def test_chain_passes_switch_verification_at_every_switch(env, data_prefix, tmp_path):
    args = _setup(tmp_path, data_prefix, CHAIN)
    if qkv_layout(env.repo) == "blocked":
        with pytest.raises(ChainError, match="changes the tensor-parallel degree"):
            run_mds_chain(chain_run_from_args(args), env)
        assert not (tmp_path / "work").exists()  # refused before anything ran
        return
    state = run_mds_chain(chain_run_from_args(args), env)
    assert [stage.status for stage in state.stages] == ["done"] * 3
    assert (
        state.stages[-1].last_iteration == 12
        and state.stages[-1].consumed_tokens == (4 * 4 + 4 * 4 + 4 * 8) * 64
    )
    checks = _checks(tmp_path / "logs" / "it")
    assert sorted(checks) == [2, 3] and all(check["status"] == "passed" for check in checks.values())
    records = [
        json.loads(line) for line in (tmp_path / "logs" / "it" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [record["iteration"] for record in records] == list(range(1, 13))
    assert all(np.isfinite(record["loss"]) for record in records)


def test_verification_refuses_the_tp_switch_without_the_repairs(env, data_prefix, tmp_path):
    args = _setup(tmp_path, data_prefix, [CHAIN[0], {**CHAIN[1], "convert": False}])
    blocked = qkv_layout(env.repo) == "blocked"
    # Per-head QKV: only defect A is left, so switch the cat_dim repair off. Blocked QKV: the repair runs, and
    # defect B (which only the up-front check catches) must be caught by verification instead.
    with pytest.raises(
        CheckpointError, match="switch verification refused checkpoint .*global_step4_universal"
    ):
        run_mds_chain(chain_run_from_args(args), env, repair=blocked, check_qkv=False)
    layout = tmp_path / "work" / "checkpoints" / "it" / "gpt-mds" / "z1" / "fp32" / "tp1_pp2_dp1_sp1"
    assert (layout / "global_step4").is_dir() and (
        layout / "latest_universal"
    ).read_text() == "global_step4_universal"
    verdict = json.loads((tmp_path / "logs" / "it" / "stages" / "2" / "switch_check.json").read_text())
    assert verdict["status"] == "failed" and verdict["difference"] > verdict["tolerance"]
    assert not (
        tmp_path / "work" / "checkpoints" / "it" / "gpt-mds" / "z1" / "fp32" / "tp2_pp1_dp1_sp1"
    ).exists()


ONLINE_ITERS = 30


def test_online_run_switches_on_measured_values_and_its_realized_chain_replays(env, data_prefix, tmp_path):
    """Online mode through the checkout: the hooks' gradient-noise lines and Megatron's step times reach
    the decisions, a switch goes through the checkpoint, ds_to_universal and verification (the frontier's
    gbs-8 strategy changes mbs, which this backend does not switch in place), and ``realized_chain.json``
    replays through the same backend to the same books and losses."""
    if qkv_layout(env.repo) == "blocked":
        pytest.skip("online mode is refused on a blocked-QKV checkout (covered by the CLI tests)")
    args = _setup(tmp_path, data_prefix, CHAIN, lr_decay_tokens=20_000)
    run = _online_run(args, tmp_path)
    lines: list[str] = []
    state = run_mds_online(run, env, out=lines.append)

    assert len(state.stages) >= 2 and state.stages[-1].last_iteration == ONLINE_ITERS
    decisions = [json.loads(line) for line in (run.run_dir / "decisions.jsonl").read_text().splitlines()]
    switch = next(d for d in decisions if d["decision"] == "switch")
    assert switch["measured_noise_scale"] is not None and switch["measured_noise_scale"] > 0
    assert switch["current"]["measured_tokens_per_s"] > 0  # from the log's step times
    checks = _checks(run.run_dir)
    assert checks and all(check["status"] == "passed" for check in checks.values())
    records = [json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    # Every stage's first step is unpaired (one small batch per step: the difference estimator), the others
    # carry the hooks' gradient-noise inputs.
    firsts = {stage.start_iteration + 1 for stage in state.stages}
    assert all(r["gns_big_sqr"] is not None for r in records if r["iteration"] not in firsts)

    replay_losses = _replay(args, run, state, env)
    online_losses = {record["iteration"]: record["loss"] for record in records}
    assert replay_losses == pytest.approx(online_losses, rel=1e-5)


def _replay(
    args: argparse.Namespace, run: OnlineRun, state: RunState, env: MdsEnvironment
) -> dict[int, float]:
    """Replay the online run's ``realized_chain.json`` through the backend (checkpoints at every switch);
    checks it reaches the same books, returns its losses by iteration."""
    args.chain, args.run_name = str(run.run_dir / "realized_chain.json"), "replay"
    replayed = run_mds_chain(chain_run_from_args(args), env)
    books = [(s.last_iteration, s.consumed_samples, s.consumed_tokens) for s in replayed.stages]
    assert books == [(s.last_iteration, s.consumed_samples, s.consumed_tokens) for s in state.stages]
    return {r["iteration"]: r["loss"] for r in _records(run.run_dir.parent / "replay")}


def _online_run(args: argparse.Namespace, tmp_path: Path, **policy_overrides: float) -> OnlineRun:
    """The online run of the tests (``args`` from :func:`_setup` with one LR horizon, ``lr_decay_tokens``,
    for the online run and its replay: else online mode ends the cosine at --total-iters x the initial
    gbs, the replayed chain at its own tokens, and their losses would differ by more than float noise)."""
    config = resolve_log_root(load_config(args.config))
    return OnlineRun(
        config=config,
        workdir=tmp_path / "work",
        run_dir=tmp_path / "logs" / "online",
        world_size=2,
        device_type="cpu",
        system="cpu_gloo",
        initial_gbs=4,
        max_gbs=8,
        total_iters=ONLINE_ITERS,
        botorch=False,
        base_port=None,
        quiet=True,
        # A 30-iteration run of this model measures a noise scale of a few samples, where no larger batch
        # pays, and a Megatron restart costs more than the rest of the run: decide as a long run would.
        noise_scale_floor=1000.0,
        policy_overrides={"predicted_switch_cost_s": 0.0, **policy_overrides},
        backend="megatron-deepspeed",
    )


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


NODES_TIMEOUT_S = 900  # two stages, a conversion and a verification launch on a shared 2-core machine
NODES_CHAIN = [CHAIN[0], {**CHAIN[2], "step_num": 2}]  # tp1/pp2 -> tp1/pp1/dp2: no tp change (any checkout)


def test_two_loopback_nodes_give_the_losses_of_one_node(env, data_prefix, tmp_path):
    """The same chain on one node with 2 processes and on two "nodes" of one process each (two runners on
    this machine, ``--no-ssh --node-rank R``, a loopback hostfile): the same books and losses."""
    args = _setup(tmp_path, data_prefix, NODES_CHAIN)
    one_node = run_mds_chain(chain_run_from_args(args), env)
    (tmp_path / "hostfile").write_text("127.0.0.1 slots=1\n127.0.0.2 slots=1\n")
    node_args = ["--num-nodes", "2", "--gpus-per-node", "1", "--hostfile", str(tmp_path / "hostfile")]
    node_args += ["--master-addr", "127.0.0.1", "--master-port-base", str(_free_port_base()), "--no-ssh"]
    command = [sys.executable, "-m", "cona", "train", "--chain", args.chain, "--config", args.config]
    command += ["--workdir", str(tmp_path / "work-nodes"), "--run-name", "nodes", "--quiet", *node_args]
    command += ["--repo-path", str(env.repo), "--mds-python", str(env.python)]
    command += ["--mds-shim", str(env.shim)] if env.shim is not None else []
    process_env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PYTHONUNBUFFERED": "1"}
    runners = []
    for rank in (0, 1):
        log = open(tmp_path / f"node{rank}.out", "w")  # noqa: SIM115 (closed with the process)
        runners.append(subprocess.Popen([*command, "--node-rank", str(rank)], stdout=log,
                                        stderr=subprocess.STDOUT, env=process_env, cwd=tmp_path))  # fmt: skip
    try:
        codes = [runner.wait(timeout=NODES_TIMEOUT_S) for runner in runners]
    finally:
        for runner in runners:
            if runner.poll() is None:
                runner.kill()
    outputs = {rank: (tmp_path / f"node{rank}.out").read_text()[-3000:] for rank in (0, 1)}
    assert codes == [0, 0], outputs
    two_nodes = load_state(tmp_path / "logs" / "nodes")
    books = [(s.last_iteration, s.consumed_samples, s.consumed_tokens) for s in two_nodes.stages]
    assert books == [(s.last_iteration, s.consumed_samples, s.consumed_tokens) for s in one_node.stages]
    checks = _checks(tmp_path / "logs" / "nodes")
    assert sorted(checks) == [2] and checks[2]["status"] == "passed"
    losses = {name: _losses(tmp_path / "logs" / name) for name in ("it", "nodes")}
    assert sorted(losses["nodes"]) == list(range(1, 9))
    assert losses["nodes"] == pytest.approx(losses["it"], rel=1e-5)


def _losses(run_dir: Path) -> dict[int, float]:
    return {
        r["iteration"]: r["loss"]
        for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    }
