"""A tiny real chain for end-to-end tests on 2 CPU processes: the tiny example's GPT shape at seq 32 on a
learnable dataset (a fixed random Markov chain, see test_chain_e2e.write_markov_dataset), with the options
of ``cona train --chain`` for running it in-process through
:func:`cona.runner.schedules.chain_schedule.run_chain`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from test_chain_e2e import VOCAB, free_port_base, write_markov_dataset

EXAMPLE_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "tiny" / ".conaconfig"
SEQ = 32


def write_config_and_data(directory: Path) -> Path:
    """``<directory>/.conaconfig`` and its dataset ``<directory>/data/markov``; returns the config path."""
    write_markov_dataset(directory / "data" / "markov", documents=300, seed=1)
    example = json.loads(EXAMPLE_CONFIG.read_text())
    config = {
        "model": {**example["model"], "seq": SEQ, "vocab_size": VOCAB},
        "training": {
            "seed": 7,
            "device": "cpu",
            "dtype": "fp32",
            "zero_stage": example["training"]["zero_stage"],
            "base_gbs": 8,
            "base_lr": 3e-3,
            "base_min_lr": 3e-4,
            "lr_warmup_tokens": 256,
            "split": "90,10,0",
            "data_prefix": "data/markov",
            "log_interval": 1,
            "eval_interval": 1_000_000,
            "eval_iters": 1,
            "log_root": "logs",
        },
    }
    path = directory / ".conaconfig"
    path.write_text(json.dumps(config, indent=1))
    return path


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
