"""Checkpoints: layout paths, markers, crash safety and resharding (refusals: test_checkpoint_refusals.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tests.helpers.small_checkpoint import ONE, assert_same_state, save, small_config, trained
from tests.helpers.torchrun_util import run_torchrun
from tests.helpers.workers import ckpt_worker

from cona.config import parse_config
from cona.engine.checkpoint import save as ckpt
from cona.engine.checkpoint.files import verify_complete
from cona.engine.checkpoint.info import read_checkpoint_info, resolve_checkpoint
from cona.engine.checkpoint.load import load_checkpoint, verify_checkpoint
from cona.engine.checkpoint.manifest import FORMAT_VERSION
from cona.engine.checkpoint.paths import layout_dir, resume_folders
from cona.engine.checkpoint.save import save_checkpoint
from cona.engine.model import GPT
from cona.engine.optim import build_optimizer, set_lr
from cona.strategy import Strategy

WORKER = Path(ckpt_worker.__file__)


@pytest.fixture
def saved(tmp_path: Path):
    config = small_config()
    model, optimizer = trained(config)
    return config, save(tmp_path, config, model, optimizer, 2), (model, optimizer)


def test_layout_dir_is_the_seeds_layout_under_the_runs_folder() -> None:
    strategy = Strategy(dp=2, tp=4, pp=3, mbs=1, gbs=8, zero_stage=3)
    path = layout_dir(Path("/w"), small_config(), strategy, "bf16", run_name="first")
    assert path == Path("/w/checkpoints/first/gpt/z3/bf16/tp4_pp3_dp2_sp1")
    other = layout_dir(Path("/w"), small_config(), strategy, "bf16", run_name="second")
    assert other == Path("/w/checkpoints/second/gpt/z3/bf16/tp4_pp3_dp2_sp1")
    assert resume_folders(Path("/w"), small_config(), strategy, "bf16", run_name="first") == (
        path,
        Path("/w/checkpoints/gpt/z3/bf16/tp4_pp3_dp2_sp1"),  # where older versions kept every run's
    )


def test_save_writes_dir_json_files_and_latest_last(saved) -> None:
    config, path, _ = saved
    assert path.name == "global_step2"
    assert (path.parent / "latest").read_text().strip() == "global_step2"
    names = {p.name for p in path.iterdir()}
    assert {".metadata", "trainer_state.json", "config.json", "strategy.json", "manifest.json"} <= names
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format_version"] == FORMAT_VERSION and manifest["iteration"] == 2
    assert set(manifest["files"]) == names - {"manifest.json"}  # every other file, with its checksum
    assert manifest["model_shape"]["hidden"] == 16 and "layers.0.w1.weight" in manifest["model_tensors"]
    assert "state.layers.0.w1.weight.exp_avg_sq" in manifest["optimizer_tensors"]
    info = read_checkpoint_info(path.parent)
    assert info.trainer_state == {"iteration": 2, "consumed_tokens": 64}
    assert info.strategy == ONE and info.config.model == config.model
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".tmp-")]


def test_round_trip_restores_model_and_optimizer(saved) -> None:
    config, path, original = saved
    model, optimizer = trained(config, steps=1, offset=0.5)
    state = load_checkpoint(path.parent, model_parts=[model], optimizer=optimizer, config=config)
    assert state["iteration"] == 2
    assert_same_state(original, (model, optimizer))


def test_load_keeps_the_current_configs_hyperparameters(saved) -> None:
    config, path, _ = saved
    changed = parse_config({"model": ckpt_worker.SMALL, "training": {"weight_decay": 0.3, "adam_eps": 1e-5}})
    model, optimizer = trained(changed, steps=0)
    for group in optimizer.param_groups:  # as if built on a device where the saved kernel choice is wrong
        group["foreach"] = False
    load_checkpoint(path, model_parts=[model], optimizer=optimizer, config=changed)
    assert {g["weight_decay"] for g in optimizer.param_groups} == {0.3, 0.0}
    assert {g["eps"] for g in optimizer.param_groups} == {1e-5}
    assert {g["foreach"] for g in optimizer.param_groups} == {False}
    assert {g["lr"] for g in optimizer.param_groups} == {0.02}  # the saved LR (set at step 2)


def test_markers_and_direct_paths_resolve(saved, tmp_path: Path) -> None:
    _, path, _ = saved
    layout = path.parent
    assert resolve_checkpoint(layout) == path
    assert resolve_checkpoint(layout / "latest") == path
    assert resolve_checkpoint(path) == path
    # A published universal copy (hard links) next to it, named by latest_universal only.
    universal = tmp_path / "published" / "global_step2_universal"
    universal.mkdir(parents=True)
    for file in path.iterdir():
        os.link(file, universal / file.name)
    (universal.parent / "latest_universal").write_text("global_step2_universal\n")
    assert resolve_checkpoint(universal.parent) == universal
    assert resolve_checkpoint(universal.parent / "latest_universal") == universal
    verify_checkpoint(universal)  # the manifest holds for the hard-linked copy


def test_a_later_save_moves_latest_and_resaving_an_iteration_replaces_it(saved) -> None:
    config, path, (model, optimizer) = saved
    ckpt_worker.train_step(model, optimizer, 3)
    newer = save(path.parents[6], config, model, optimizer, 3)
    assert resolve_checkpoint(path.parent) == newer and path.is_dir()
    again = save(path.parents[6], config, model, optimizer, 3)
    assert again == newer and resolve_checkpoint(path.parent) == newer
    verify_complete(newer)
    assert sorted(p.name for p in path.parent.iterdir()) == ["global_step2", "global_step3", "latest"]


def test_a_save_that_must_not_become_latest_leaves_latest_on_the_previous_one(saved) -> None:
    """A state unfit to resume from (:mod:`cona.engine.divergence`) is saved, but ``latest`` stays."""
    config, path, (model, optimizer) = saved
    ckpt_worker.train_step(model, optimizer, 3)
    unfit = save_checkpoint(
        path.parent,
        iteration=3,
        model_parts=[model],
        optimizer=optimizer,
        trainer_state={"iteration": 3},
        config=config,
        strategy=ONE,
        move_latest=False,
    )
    verify_complete(unfit)
    assert resolve_checkpoint(path.parent) == path


def test_interleaved_parts_save_under_global_names(tmp_path: Path) -> None:
    """Two model parts on one rank (interleaved pipeline) with one optimizer save and load like one model."""
    config = small_config()
    whole, whole_optimizer = trained(config)
    first, second = (ckpt_worker.build_model(config, ONE, None, 0.0) for _ in range(2))
    for key in ("2", "3"):
        del first.layers[key]
    for key in ("0", "1"):
        del second.layers[key]
    first.norm = first.output = second.tok_embeddings = None
    optimizer = build_optimizer([first, second], config.training)
    for step in (1, 2):
        for part in (first, second):
            for param in part.parameters():
                param.grad = torch.sin(param.detach() * 3.0 + step)
        set_lr(optimizer, 0.01 * step)
        optimizer.step()
    path = save_checkpoint(
        layout_dir(tmp_path, config, ONE, "fp32", run_name="run"),
        iteration=2,
        model_parts=[first, second],
        optimizer=optimizer,
        trainer_state={"iteration": 2},
        config=config,
        strategy=ONE,
    )
    model, fresh_optimizer = trained(config, steps=0, offset=0.5)
    load_checkpoint(path, model_parts=[model], optimizer=fresh_optimizer, config=config)
    assert_same_state((whole, whole_optimizer), (model, fresh_optimizer))


# ------------------------------------------------------------------------------------ crash safety


def test_crash_before_rename_keeps_previous_latest_and_next_save_cleans_up(saved, monkeypatch) -> None:
    config, path, (model, optimizer) = saved
    root = path.parents[6]

    def crash(*_args) -> None:
        raise KeyboardInterrupt("killed between the shards and the rename")

    monkeypatch.setattr(ckpt, "_publish", crash)
    with pytest.raises(KeyboardInterrupt):
        save(root, config, model, optimizer, 3)
    leftovers = [p for p in path.parent.iterdir() if p.name.startswith(".tmp-global_step3")]
    assert len(leftovers) == 1 and (leftovers[0] / ".metadata").is_file()
    assert resolve_checkpoint(path.parent) == path
    fresh = trained(config, steps=0, offset=0.5)
    assert (
        load_checkpoint(path.parent, model_parts=[fresh[0]], optimizer=fresh[1], config=config)["iteration"]
        == 2
    )
    monkeypatch.undo()
    save(root, config, model, optimizer, 3)
    assert not leftovers[0].exists()


def test_crash_before_marker_leaves_previous_latest(saved, monkeypatch) -> None:
    config, path, (model, optimizer) = saved

    def crash(*_args) -> None:
        raise KeyboardInterrupt("killed before the marker")

    monkeypatch.setattr(ckpt, "_write_marker", crash)
    with pytest.raises(KeyboardInterrupt):
        save(path.parents[6], config, model, optimizer, 3)
    assert (path.parent / "global_step3").is_dir()
    assert resolve_checkpoint(path.parent) == path  # the new one is complete but not yet named


@pytest.mark.slow
def test_sigkill_during_save_keeps_the_previous_checkpoint_loadable(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        [sys.executable, str(WORKER), str(tmp_path), "--save-loop", "dp1_tp1_pp1_z1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )
    config = parse_config({"model": ckpt_worker.BIG, "training": {}})
    layout = layout_dir(tmp_path, config, ONE, "fp32", run_name="run")
    try:
        killed_mid_save = wait_for_save_in_progress(layout, process)
    finally:
        process.kill()
        output = process.communicate(timeout=30)[0].decode()
    assert killed_mid_save, f"the worker never started a second save:\n{output[-2000:]}"
    assert process.returncode == -signal.SIGKILL
    assert [p for p in layout.iterdir() if p.name.startswith(".tmp-global_step")], "not killed mid-save"
    checkpoint = resolve_checkpoint(layout)
    verify_complete(checkpoint)
    iteration = int(checkpoint.name.removeprefix("global_step"))
    model = ckpt_worker.build_model(config, ONE, None, 0.5)
    optimizer = build_optimizer([model], config.training)
    assert (
        load_checkpoint(layout, model_parts=[model], optimizer=optimizer, config=config)["iteration"]
        == iteration
    )


def wait_for_save_in_progress(layout: Path, process: subprocess.Popen, timeout: float = 90) -> bool:
    """Once a checkpoint exists, SIGKILL the worker as soon as the next save has written a shard file."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        if (layout / "latest").is_file():
            for tmp in layout.glob(".tmp-global_step*"):
                if any(tmp.glob("*.distcp")):  # glob of a just-renamed directory is simply empty
                    process.send_signal(signal.SIGKILL)
                    process.wait()
                    return True
        time.sleep(0.002)
    return False


# ------------------------------------------------------------------------------------ resharding


RESHARD_2 = {
    "save": ["dp2_tp1_pp1_z1", "dp1_tp2_pp1_z1", "dp1_tp1_pp2_z1"],
    "load": [
        "dp2_tp1_pp1_z1:dp1_tp1_pp2_z1_v2",
        "dp1_tp2_pp1_z1:dp2_tp1_pp1_z3",
        "dp1_tp1_pp2_z1:dp2_tp1_pp1_z0",
    ],
}
RESHARD_4 = {
    "save": ["dp2_tp2_pp1_z3"],
    "load": ["dp2_tp2_pp1_z3:dp1_tp2_pp2_z1", "dp1_tp1_pp2_z1:dp2_tp2_pp1_z1"],
}


RESHARD_FAMILY_2 = {
    "save": ["dp1_tp2_pp1_z1", "dp1_tp1_pp2_z1"],
    "load": ["dp1_tp2_pp1_z1:dp1_tp1_pp2_z1", "dp1_tp1_pp2_z1:dp2_tp1_pp1_z3"],
}
"""Llama and BERT: tensor-parallel (llama: one key/value head per rank) to pipeline and pipeline to FSDP."""


def _tensor_counts(family: str) -> str:
    """What the worker reports for a full reload: every model state tensor (the tied head listed too) and
    three AdamW tensors per parameter."""
    model_keys = {**ckpt_worker.REAL, **ckpt_worker.FAMILY_KEYS[family]}
    config = parse_config({"model": model_keys, "training": ckpt_worker.FAMILY_TRAINING.get(family, {})})
    model = GPT(config.model)
    return f"{len(model.state_dict())} model and {3 * len(list(model.parameters()))} optimizer tensors equal"


def _family_lines(stdout: str) -> dict[str, str]:
    """The worker's output of a ``--plan`` launch, by family."""
    sections = stdout.split("family ")[1:]
    return {section.split("\n", 1)[0]: section for section in sections}


@pytest.mark.slow
@pytest.mark.multiproc
def test_engine_model_reshards_between_layouts_and_to_one_process(tmp_path: Path) -> None:
    """The engine's model saved under some layouts and resumed under others and under one process without a
    process group: every model and AdamW tensor equal on reload, and the next two losses equal to the
    uninterrupted run's. GPT: saved under dp2 (zero 1), tp2, pp2 and dp2 x tp2 (zero 3), resumed under zero
    0/1/3, interleaved pp and tp2 x pp2; Llama and BERT: :data:`RESHARD_FAMILY_2`. One launch per process
    count for all three families (a launch's start is most of a family's time)."""
    launches = {
        2: {"gpt": RESHARD_2, "llama": RESHARD_FAMILY_2, "bert": RESHARD_FAMILY_2},
        4: {"gpt": RESHARD_4},
        1: {
            family: {"load": [f"{layout}:dp1_tp1_pp1_z1" for layout in saved]}
            for family, saved in {
                "gpt": RESHARD_2["save"] + RESHARD_4["save"],
                "llama": RESHARD_FAMILY_2["save"],
                "bert": RESHARD_FAMILY_2["save"],
            }.items()
        },
    }
    worker = [str(WORKER), str(tmp_path), "--real"]
    for nproc, plans in launches.items():
        args = [*worker, "--plan", json.dumps(plans)]
        result = (
            run_torchrun(args, nproc=nproc, timeout=600)
            if nproc > 1
            else subprocess.run(
                [sys.executable, *args],
                capture_output=True,
                text=True,
                timeout=600,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
        )
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        lines = _family_lines(result.stdout)
        assert sorted(lines) == sorted(plans)
        for family, plan in plans.items():
            counts = _tensor_counts(family)
            for pair in plan["load"]:
                assert f"loaded {pair.replace(':', '->')}: {counts}" in lines[family], (family, pair)
