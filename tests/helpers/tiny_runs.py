"""Tiny real runs on 2 CPU processes: the options of ``cona train`` (fixed) and of ``cona train --chain``
(for running a chain in-process through
:func:`cona.runner.schedules.chain_schedule.run_chain`), chain files, a one-process online run that switches
in place, and what a run's metrics say."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tests.helpers.tiny import write_tiny_config
from tests.helpers.torchrun_util import free_port_block

from cona.config.file import load_config
from cona.runner.run_dir import resolve_log_root
from cona.runner.schedules.online import OnlineRun


def free_port_base(stages: int = 7) -> int:
    """A base port that is free right now, as are its stages' ports (base + 1 ... base + stages): a run
    across nodes hosts the runners' store on the base itself. Seven stages cover every chain of these
    tests."""
    return free_port_block(stages + 1)


def train_args(
    config: Path, workdir: Path, *extra: str, dp=2, tp=1, pp=1, gbs=8, mbs=2, iters=4
) -> list[str]:
    """The arguments of ``cona train`` for a fixed strategy (``cona.cli.main`` takes them)."""
    return [
        "train",
        "--config",
        str(config),
        "--workdir",
        str(workdir),
        "--dp",
        str(dp),
        "--tp",
        str(tp),
        "--pp",
        str(pp),
        "--gbs",
        str(gbs),
        "--mbs",
        str(mbs),
        "--iters",
        str(iters),
        "--master-port-base",
        str(free_port_base()),
        *extra,
    ]


def write_chain(path: Path, steps: list[dict]) -> Path:
    """A chain file of ``steps`` (numbered from 1 here)."""
    numbered = [{"step_num": number, **step} for number, step in enumerate(steps, start=1)]
    path.write_text(json.dumps({"steps": numbered}, indent=1))
    return path


def chain_args(config: Path, chain: Path, workdir: Path, run_name: str, *, stages: int) -> argparse.Namespace:
    """What ``cona train --chain CHAIN --config CONFIG --workdir W --run-name N --gpus 2 --quiet`` gives."""
    return argparse.Namespace(
        chain=str(chain),
        config=str(config),
        workdir=workdir,
        run_name=run_name,
        gpus=2,
        device="cpu",
        master_port_base=free_port_base(stages),
        quiet=True,
        fresh=False,
    )


def in_place_run(tmp_path, *, total_iters: int) -> tuple[OnlineRun, dict]:
    """An online run on one process, gbs 2 -> 4 (every strategy has the same layout: in place), committing
    its switch; with the config it wrote to ``tmp_path/.conaconfig``."""
    # One LR horizon whatever the gbs (without it online mode ends the cosine at --total-iters x the initial
    # gbs, a replayed chain at its own tokens): the losses compared must differ only by the switch.
    training = {"log_interval": 1, "eval_interval": 100, "lr_decay_tokens": 100_000}
    model = {"hidden": 128, "seq": 64}  # steps of milliseconds, not microseconds
    config_path = write_tiny_config(tmp_path, data="random", model=model, training=training)
    raw = json.loads(config_path.read_text())
    run = OnlineRun(
        config=resolve_log_root(load_config(config_path)),
        workdir=tmp_path / "work",
        run_dir=tmp_path / "logs" / "inplace",
        world_size=1,
        device_type="cpu",
        system="cpu_gloo",
        initial_gbs=2,  # mbs 2: a measured step's halves give the noise scale at the same parameters
        max_gbs=4,
        total_iters=total_iters,
        botorch=False,
        base_port=free_port_base(),
        quiet=True,
        noise_scale_floor=1000.0,
        policy_overrides={
            "predicted_switch_cost_s": 0.0,
            "predicted_in_place_cost_s": 0.0,
            "probe": False,  # decided on the noise-scale model: test_online_probe_e2e.py probes
        },
    )
    return run, raw


def final_records(run_dir: Path) -> dict[int, dict]:
    """Each iteration's last metrics line (a resumed run's for the iterations it retrained)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {record["iteration"]: record for record in map(json.loads, lines)}
