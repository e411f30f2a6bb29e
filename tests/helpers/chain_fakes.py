"""A stand-in for the training workers, for testing the chain runner's sequencing and resume logic.

:class:`FakeEngine` is a launcher: it "trains" a stage in-process by reading the trainer state of the
checkpoint the spec names, advancing iteration and consumed samples/tokens exactly as training would, and
saving a real (tiny) checkpoint with the engine's own ``save_checkpoint``, then writing ``stage_result.json``.
It can kill its own process at chosen points, to test resume after SIGKILL.

:func:`run_until_killed` runs a whole chain with the fake engine in a child process that dies by SIGKILL at
one of :data:`KILL_POINTS`; the tests rerun the chain afterwards.

The fake chains train the tiny config with :data:`FAKE_MODEL` (:func:`write_fake_chain_config`,
:func:`setup_run`); :func:`make_checkpoint` saves a real one-process checkpoint of it.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from tests.helpers.forked import fork
from tests.helpers.tiny import write_tiny_config

from cona.config.file import load_config
from cona.engine.checkpoint.info import read_checkpoint_info
from cona.engine.checkpoint.paths import layout_dir, tmp_owner
from cona.engine.checkpoint.save import save_checkpoint
from cona.engine.spec import StageResult
from cona.runner.schedules.chain_schedule import ChainRun, StageLaunch, run_chain
from cona.strategy import Strategy

KILL_POINTS = ("training", "save", "between_stages", "publish", "prune")

FAKE_MODEL = {"name": "tiny", "layers": 4, "hidden": 16, "heads": 4, "seq": 8, "vocab_size": 64}
"""The model the fake chains train: 4 layers (a layout of pp 2 splits them), named "tiny" in the layouts'
paths (:func:`tiny_layout`)."""


def write_fake_chain_config(directory: Path) -> Path:
    """``directory/.conaconfig``: the tiny config with :data:`FAKE_MODEL`; returns its path."""
    return write_tiny_config(directory, model=FAKE_MODEL)


def tiny_layout(tp: int, pp: int, dp: int) -> str:
    """The layout as a chain file's pruning entry names it (the seed's form, without the run)."""
    return f"checkpoints/tiny/z1/fp32/tp{tp}_pp{pp}_dp{dp}_sp1"


def run_layout(tp: int, pp: int, dp: int, run: str = "run") -> str:
    """Where run ``run`` keeps its checkpoints of the layout, relative to the workdir."""
    return f"checkpoints/{run}/tiny/z1/fp32/tp{tp}_pp{pp}_dp{dp}_sp1"


def seed_shaped_chain(iters: int = 3) -> dict:
    """The three-stage shape of examples/gpt/chain_config.json on 4 processes: dp2/pp2 gbs 8 -> dp4
    gbs 16 -> dp4 gbs 32."""
    return {
        "steps": [
            {
                "step_num": 1,
                "dp": 2,
                "tp": 1,
                "pp": 2,
                "gbs": 8,
                "mbs": 2,
                "train_iters": iters,
                "is_initial": True,
                "convert": True,
            },
            {
                "step_num": 2,
                "dp": 4,
                "tp": 1,
                "pp": 1,
                "gbs": 16,
                "mbs": 4,
                "extra_iters": iters,
                "load_dp": 2,
                "load_tp": 1,
                "load_pp": 2,
                "convert": True,
            },
            {
                "step_num": 3,
                "dp": 4,
                "tp": 1,
                "pp": 1,
                "gbs": 32,
                "mbs": 4,
                "target_iters": 3 * iters,
                "load_dp": 4,
                "load_tp": 1,
                "load_pp": 1,
            },
        ],
        "pruning": [
            {"stage": 1, "ckpt_dir": tiny_layout(1, 2, 2), "mode": "keep-latest"},
            {"stage": 3, "ckpt_dir": tiny_layout(1, 1, 4), "mode": "delete-all"},
        ],
    }


@dataclass
class FakeEngine:
    """Launcher that trains nothing but keeps the books (and the checkpoints) as the engine would."""

    kill_at: str | None = None
    """``training``: after a mid-stage checkpoint; ``save``: with a save's shards half written."""
    kill_stage: int = 2
    launches: list[StageLaunch] = field(default_factory=list)

    def __call__(self, launch: StageLaunch) -> None:
        self.launches.append(launch)
        spec = launch.spec
        started = time.time()
        iteration, samples, tokens = 0, 0, 0
        if spec.load_path is not None:
            loaded = read_checkpoint_info(spec.load_path).trainer_state
            iteration, samples, tokens = (
                loaded["iteration"],
                loaded["consumed_samples"],
                loaded["consumed_tokens"],
            )
        loaded_at = time.time()
        target_dir = layout_dir(spec.workdir, spec.config, spec.strategy, "fp32", run_name=spec.run_name)
        gbs, seq = spec.strategy.gbs, spec.config.model.seq
        killing = self.kill_at is not None and spec.stage == self.kill_stage
        if killing and self.kill_at == "training":
            half = iteration + (spec.target_iteration - iteration) // 2
            self._save(
                spec,
                target_dir,
                half,
                samples + (half - iteration) * gbs,
                tokens + (half - iteration) * gbs * seq,
            )
            os.kill(os.getpid(), signal.SIGKILL)
        if killing and self.kill_at == "save":
            dcp.save(
                {"model": {"w": torch.zeros(4)}},
                checkpoint_id=target_dir / ".tmp-global_step99-dead",
                no_dist=True,
            )
            os.kill(os.getpid(), signal.SIGKILL)
        steps = spec.target_iteration - iteration
        samples, tokens = samples + steps * gbs, tokens + steps * gbs * seq
        trained = time.time()
        checkpoint = self._save(spec, target_dir, spec.target_iteration, samples, tokens)
        timings = {
            "process_start": started,
            "setup_done": loaded_at,
            "first_step_done": loaded_at,
            "train_done": trained,
            "save_done": time.time(),
        }
        StageResult(
            stage=spec.stage,
            reason="completed",
            last_iteration=spec.target_iteration,
            consumed_samples=samples,
            consumed_tokens=tokens,
            checkpoint=str(checkpoint),
            timings=timings,
        ).write(spec.result_path)

    @staticmethod
    def _save(spec, target_dir: Path, iteration: int, samples: int, tokens: int) -> Path:
        model = torch.nn.Linear(2, 2)
        torch.nn.init.constant_(model.weight, float(iteration))
        optimizer = torch.optim.AdamW(model.parameters())
        trainer_state = {
            "iteration": iteration,
            "consumed_samples": samples,
            "consumed_tokens": tokens,
            "stage": spec.stage,
            "run": tmp_owner(spec.run_dir),  # as the engine records it
            "lr_factor": spec.lr_factor,
        }
        return save_checkpoint(
            target_dir,
            iteration=iteration,
            model_parts=[model],
            optimizer=optimizer,
            trainer_state=trainer_state,
            config=spec.config,
            strategy=spec.strategy,
        )


def chain_run(workdir: Path, chain_path: Path, *, fresh: bool = False) -> ChainRun:
    config = load_config(workdir / ".conaconfig")
    return ChainRun(
        chain_path=chain_path,
        config=config,
        workdir=workdir,
        run_dir=workdir / "logs" / "run",
        world_size=4,
        device_type="cpu",
        fresh=fresh,
    )


def _kill_self(*_args, **_kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


def install_kill_point(point: str, engine: FakeEngine) -> None:
    """Arrange for this process to die at ``point`` (stage 2 for the engine's points, else after stage 1)."""
    import cona.runner.driver as driver_module  # the driver saves every move of the run state
    import cona.runner.publish as publish_module

    if point in ("training", "save"):
        engine.kill_at = point
    elif point == "publish":  # one file linked, the rest not: a half-built universal directory
        real_link = publish_module._link_or_copy
        calls = []

        def link_then_die(source, target):
            calls.append(source)
            if len(calls) == 2:
                _kill_self()
            real_link(source, target)

        publish_module._link_or_copy = link_then_die
    elif point == "prune":  # a directory renamed aside but not yet deleted

        def rename_then_die(path):
            os.replace(path, path.with_name(path.name + ".deleting"))
            _kill_self()

        publish_module._remove_dir = rename_then_die
    elif point == "between_stages":  # stage 1 recorded done, stage 2 not planned yet
        real_save = driver_module.save_state

        def save_then_die(run_dir, state):
            real_save(run_dir, state)
            if state.stage(1).status == "done":
                _kill_self()

        driver_module.save_state = save_then_die
    else:
        raise ValueError(f"unknown kill point {point!r}")


def run_until_killed(workdir: Path, chain_path: Path, kill_point: str) -> int:
    """Run the chain in a forked child that SIGKILLs itself at ``kill_point``; returns its wait status.

    Forking (rather than starting a new interpreter) saves the seconds of importing torch again; the child
    uses one thread, as forked DataLoader workers do, and never returns into the test."""
    pid = fork()
    if pid == 0:
        status = 3  # reaching the end means the kill point was never hit
        try:
            torch.set_num_threads(1)
            engine = FakeEngine()
            install_kill_point(kill_point, engine)
            run_chain(chain_run(workdir, chain_path), launcher=engine, out=lambda line: None)
        except BaseException:  # noqa: BLE001 (any failure must end the child, not continue the test in it)
            status = 4
        finally:
            os._exit(status)
    _, wait_status = os.waitpid(pid, 0)
    return wait_status


LAYOUT = "checkpoints/tiny/z1/fp32/tp1_pp1_dp1_sp1"
"""Where :func:`make_checkpoint` saves, relative to its workdir."""


def make_checkpoint(workdir: Path, iteration: int) -> Path:
    """A real, small DCP checkpoint saved by the engine in this one process."""
    config = load_config(write_fake_chain_config(workdir))
    model = torch.nn.Linear(3, 2)
    torch.nn.init.constant_(model.weight, float(iteration))
    optimizer = torch.optim.AdamW(model.parameters())
    state = {"iteration": iteration, "consumed_samples": 8 * iteration, "consumed_tokens": 64 * iteration}
    return save_checkpoint(
        workdir / LAYOUT,
        iteration=iteration,
        model_parts=[model],
        optimizer=optimizer,
        trainer_state=state,
        config=config,
        strategy=Strategy(dp=1, tp=1, pp=1, mbs=1, gbs=8),
    )


def setup_run(workdir: Path, chain: dict | None = None) -> Path:
    """The fake chain's config and ``chain`` (default: :func:`seed_shaped_chain`) as ``workdir/chain.json``;
    returns the chain's path."""
    write_fake_chain_config(workdir)
    path = workdir / "chain.json"
    path.write_text(json.dumps(chain or seed_shaped_chain()))
    return path
