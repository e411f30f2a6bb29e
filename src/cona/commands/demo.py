"""``cona demo [--out DIR] [--data DIR] [--gpus N]``: the README's first command, the main job on the demo
text.

The config is embedded here (the tiny GPT of ``examples/tiny/.conaconfig``); its data paths point at
``--data`` (default: a checkout's ``data/demo`` when started from the checkout, else ``demo/`` in the user
data directory, ``$XDG_DATA_HOME/cona`` or ``~/.local/share/cona``: :func:`cona.data.demo.default_demo_dir`),
obtained there first when missing; it is written into the demo's own directory ``<out>/<UTC time>/``
together with the logs and checkpoints (``--out``: default a checkout's ``runs/demo``, else ``runs/demo`` in
the user data directory: :func:`cona.data.demo.default_demo_runs`); the first line names that directory.
The job is online strategy chaining (:mod:`cona.runner.schedules.online`): 4 CPU worker processes, or one
per GPU when GPUs are visible.
"""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cona.errors import ConaError, UsageError

if TYPE_CHECKING:
    from cona.runner.run_descriptions import OnlineRun

CPU_PROCESSES = 4

DEMO_MODEL: dict[str, Any] = {
    "name": "gpt-tiny",
    "layers": 4,
    "hidden": 64,
    "heads": 4,
    "seq": 128,
    "attention_dropout": 0.0,
    "hidden_dropout": 0.0,
}
DEMO_TRAINING: dict[str, Any] = {
    "seed": 1234,
    "zero_stage": 1,
    "base_gbs": 8,
    "base_lr": 1e-3,
    "base_min_lr": 1e-4,
    "lr_scale_strategy": "sqrt",
    "lr_warmup_tokens": 16384,
    "lr_decay_tokens": 100_000,
    "weight_decay": 0.1,
    "split": "949,50,1",
    "tokenizer_type": "GPT2BPETokenizer",
    "log_interval": 2,
    "eval_interval": 20,
    "eval_iters": 4,
    "wandb_mode": "disabled",
    "probe_tokens": 4096,
}
"""``probe_tokens``: 32 samples a branch, about a second at the demo's few thousand tokens/s; the default is
sized for runs of billions of tokens and would cost the demo a third of its 100k."""
DEMO_ONLINE: dict[str, Any] = {
    "initial_gbs": 1,
    "max_gbs": 32,
    "total_tokens": 100_000,
}
"""The online run: from gbs 1 (which 4 processes can only share by tensor parallelism, so the search picks
another layout than at the larger sizes) up to 32, for 100k tokens of the demo text."""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="Run the demo: online strategy chaining of the tiny GPT on the demo text",
        description=(
            "Train the tiny GPT on the demo text with online strategy chaining: the search runs beside "
            "training and switches gbs and layout when that pays. 4 CPU processes, or the visible GPUs."
        ),
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="where the demo's runs go (default: ./runs/demo in a checkout, where ./data/demo exists, else "
        "$XDG_DATA_HOME/cona/runs/demo or ~/.local/share/cona/runs/demo); the first line names the directory",
    )
    parser.add_argument(
        "--data",
        type=Path,
        default=None,
        metavar="DIR",
        help="the demo data's directory, obtained there when missing (default: ./data/demo when it exists, "
        "as in a checkout, else $XDG_DATA_HOME/cona/demo or ~/.local/share/cona/demo)",
    )
    parser.add_argument(
        "--gpus", type=int, default=None, help="processes: default the GPU count, or 4 CPU processes"
    )
    parser.add_argument(
        "--quiet",
        action="store_true",
        help="only stage start/finish/switch lines and errors (no live progress)",
    )
    parser.set_defaults(func=_demo)


def demo_config(data_dir: Path, run_root: Path, *, device: str) -> dict[str, Any]:
    """The embedded config with absolute paths: data under ``data_dir`` (the corpus in the tiny example's
    4096-entry vocabulary), logs under ``run_root``."""
    from cona.data.demo import TINY_MERGES_NAME, TINY_OUTPUT_PREFIX, TINY_VOCAB_NAME, dataset_prefix

    training = {
        **DEMO_TRAINING,
        "device": device,
        "dtype": "bf16" if device == "cuda" else "fp32",
        "data_prefix": dataset_prefix(data_dir, TINY_OUTPUT_PREFIX),
        "vocab_file": str(data_dir / TINY_VOCAB_NAME),
        "merge_file": str(data_dir / TINY_MERGES_NAME),
        "data_cache_path": str(data_dir / "index-cache"),
        "log_root": str(run_root / "logs"),
    }
    return {"model": dict(DEMO_MODEL), "training": training}


def _demo(args: argparse.Namespace) -> int:
    import torch  # deferred: `cona --help` should not pay for it

    from cona.runner.views.console import RunConsole

    console = RunConsole.for_stdout(quiet=args.quiet)
    gpus_visible = torch.cuda.device_count()
    device = "cuda" if gpus_visible > 0 else "cpu"
    processes = args.gpus if args.gpus is not None else (gpus_visible or CPU_PROCESSES)
    if processes < 1:
        raise UsageError(f"cona demo --gpus: must be at least 1, got {processes}")
    data_dir = _demo_data_dir(args.data)
    _ensure_demo_data(data_dir)
    run_root = new_run_root(_demo_out(args.out), datetime.now(UTC))
    config_path = run_root / ".conaconfig"
    config_path.write_text(json.dumps(demo_config(data_dir, run_root, device=device), indent=1) + "\n")
    print(
        f"cona demo: {processes} {'GPU' if device == 'cuda' else 'CPU'} processes; writing to {run_root} "
        f"(--out chooses another place), config {config_path}",
        flush=True,
    )
    from cona.runner.schedules.online import run_online  # imports torch and the planner
    from cona.runner.worker_session import stage_launcher

    system = demo_system(torch.cuda.get_device_name(0) if device == "cuda" else None)
    run = _online_run(config_path, run_root, processes, system)
    with stage_launcher(restart_workers=False) as launcher:  # the stages reuse the worker processes
        run_online(run, launcher=console.launcher(launcher), out=console.message)  # measured values only
    print(f"cona demo: done; run directory, checkpoints and realized_chain.json under {run_root}")
    return 0


def new_run_root(out: Path, now: datetime) -> Path:
    """A directory of its own under ``out`` for this demo, named by the UTC time; a second demo started in
    the same second gets ``-2`` (then ``-3``, ...): creating it is the claim, so two demos never share one."""
    stamp = now.strftime("%Y%m%d-%H%M%S")
    if out.exists() and not out.is_dir():
        raise ConaError(f"cona demo --out: {out} is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        for attempt in range(1, 1000):
            run_root = (out / (stamp if attempt == 1 else f"{stamp}-{attempt}")).resolve()
            try:
                run_root.mkdir()
            except FileExistsError:
                continue
            return run_root
    except OSError as err:
        raise ConaError(f"cona demo --out: cannot create a run directory in {out}: {err.strerror}") from None
    raise ConaError(f"cona demo --out: {out} already holds 999 runs started at {stamp}")


def demo_system(gpu_name: str | None) -> str:
    """The system description of this machine: ``cpu_gloo`` on CPU, else the shipped GPU whose name the
    device's name contains (an unknown GPU is refused: the search would plan for another machine)."""
    from cona.planner.systems import available_systems

    if gpu_name is None:
        return "cpu_gloo"
    for system in available_systems():
        if system.split("_")[0] in gpu_name.lower():
            return system
    raise ConaError(
        f"cona demo: no system description for the GPU {gpu_name!r}; run cona train --system with one "
        f"(cona systems lists them)"
    )


def _online_run(config_path: Path, run_root: Path, processes: int, system: str) -> OnlineRun:
    """What ``cona train --gpus N --system S --initial-gbs ... --no-botorch --quiet`` runs."""
    from cona.commands.train_runs import device_type, run_config
    from cona.runner.run_descriptions import OnlineRun

    config = run_config(config_path, None)
    return OnlineRun(
        config=config,
        workdir=run_root,
        run_dir=Path(config.training.logging.log_root) / "online",
        world_size=processes,
        device_type=device_type(config.training),
        system=system,
        botorch=False,
        quiet=True,
        prior_on_host=True,
        **DEMO_ONLINE,
    )


def _demo_out(given: Path | None) -> Path:
    from cona.data.demo import default_demo_runs

    return given if given is not None else default_demo_runs()


def _demo_data_dir(given: Path | None) -> Path:
    from cona.data.demo import default_demo_dir

    return (given if given is not None else default_demo_dir()).expanduser().absolute()


def _ensure_demo_data(data_dir: Path) -> None:
    from cona.data.demo import demo_data_complete, obtain_demo_data

    if not demo_data_complete(data_dir):
        print(f"cona demo: obtaining the demo data into {data_dir} first", flush=True)
        obtain_demo_data(data_dir)
