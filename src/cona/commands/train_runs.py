"""``cona train``'s flags as the typed run descriptions the runner takes.

The runner never sees the parsed flags: each mode's flags become one frozen description
(:mod:`cona.runner.run_descriptions`: ``ChainRun``, ``OnlineRun``, ``FixedRun``), checked here with a message
that names the flag. What every mode shares is written once: the config with the ``--device`` override
(:func:`run_config`), the device the workers will use (:func:`device_type`) and the node placement
(:func:`placement`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cona.commands.search_flags import botorch_choice
from cona.config import ConaConfig, TrainingConfig
from cona.config.file import load_config
from cona.errors import LaunchError, UsageError
from cona.planner.systems import devices_mismatch, load_system
from cona.runner.launch import resolve_port_base
from cona.runner.nodes.multinode import NodePlacement, resolve_placement
from cona.runner.run_descriptions import ChainRun, FixedRun, OnlineRun
from cona.runner.run_dir import check_run_name, check_workdir, resolve_log_root
from cona.strategy import Strategy, configured_strategy

PLACEMENT_FLAGS = ("num_nodes", "gpus_per_node", "gpus", "hostfile", "master_addr", "node_rank", "no_ssh")


def flag(flags: Any, name: str) -> Any:
    """The flag's value, None when it was not given (or the caller's flags do not have it)."""
    return getattr(flags, name, None)


def run_config(
    config_path: str | Path | None, device: str | None, overrides: Sequence[str] | None = ()
) -> ConaConfig:
    """The config (``--config``, else the discovered ``.conaconfig``; data files checked) with the
    ``--set`` overrides, ``--device`` overriding ``training.device`` and the log root made absolute."""
    config = resolve_log_root(load_config(config_path, check_data_files=True, overrides=overrides or ()))
    if device is None:
        return config
    return dataclasses.replace(config, training=config.training.replace(device=device))


def device_type(training: TrainingConfig, *, processes: int | None = None) -> str:
    """``cpu`` or ``cuda`` as the workers will resolve ``training.device``; given ``processes`` (one node's),
    a CUDA run needs a GPU for each. Torch is imported only to ask CUDA (``auto``, or a GPU count): the runner
    needs it for nothing else, and its import is seconds of every run's start."""
    requested = training.runtime.device
    if requested == "cpu" or (requested != "auto" and processes is None):
        return requested
    import torch

    resolved = ("cuda" if torch.cuda.is_available() else "cpu") if requested == "auto" else requested
    if resolved == "cuda" and processes is not None:
        available = torch.cuda.device_count()
        if available < processes:
            raise LaunchError(
                f"dp*tp*pp = {processes} processes need {processes} GPUs, but {available} are visible "
                f"(training.device={requested}; --device cpu runs them as CPU processes)"
            )
    return resolved


def workdir(flags: Any) -> Path:
    """``--workdir``, the current directory when not given (the same default in every mode), checked."""
    return check_workdir(Path(flag(flags, "workdir") or Path.cwd()))


def placement(flags: Any) -> NodePlacement:
    """Where this node stands: the placement flags and, inside a Slurm job step, its variables."""
    return resolve_placement({name: flag(flags, name) for name in PLACEMENT_FLAGS}, os.environ)


def _common(flags: Any, config: ConaConfig, run_name: str, num_nodes: int) -> dict[str, Any]:
    """What every run description takes from the flags that all modes share."""
    run_dir = Path(config.training.logging.log_root) / check_run_name(run_name)
    return {
        "config": config,
        "workdir": workdir(flags),
        "run_dir": run_dir,
        "base_port": resolve_port_base(flag(flags, "master_port_base"), num_nodes),
        "fresh": bool(flag(flags, "fresh")),
        "resume_diverged": bool(flag(flags, "resume_diverged")),
        "quiet": bool(flag(flags, "quiet")),
    }


def chain_run(flags: Any, *, fixed: tuple[dict, str] | None = None) -> ChainRun:
    """``cona train --chain FILE [--config] [--device] [--workdir] [--gpus | --num-nodes --gpus-per-node]
    [--run-name] [--master-port-base] [--quiet] [--fresh] [--switch-in-place]``; ``fixed``: a fixed
    strategy's chain (built in memory) and run name in place of the chain file, across nodes."""
    config = run_config(flag(flags, "config"), flag(flags, "device"), flag(flags, "overrides"))
    resolved = device_type(config.training)
    nodes = placement(flags)
    chain_path = Path(flags.chain) if fixed is None else None
    name = fixed[1] if fixed is not None else flag(flags, "run_name") or f"chain-{Path(flags.chain).stem}"
    common = _common(flags, config, name, nodes.num_nodes)
    return ChainRun(
        chain_path=chain_path,
        fixed_chain=fixed[0] if fixed is not None else None,
        world_size=nodes.num_nodes * nodes.gpus_per_node
        if nodes.num_nodes > 1 or chain_path is None
        else _chain_world_size(flags, chain_path, resolved),
        device_type=resolved,
        nodes=nodes,
        switch_in_place=bool(flag(flags, "switch_in_place")),
        **common,
    )


def _chain_world_size(flags: Any, chain_path: Path, resolved_device: str) -> int:
    gpus, per_node = flag(flags, "gpus"), flag(flags, "gpus_per_node")
    if gpus is not None:
        return gpus
    if per_node is not None:
        return (flag(flags, "num_nodes") or 1) * per_node
    if resolved_device == "cuda":
        import torch

        return torch.cuda.device_count()
    first = _first_step_world_size(chain_path)
    if first is None:
        raise UsageError("--chain needs the process count: pass --gpus N (on CPU, N worker processes)")
    return first  # the short form on CPU: as many processes as the chain's first step uses


def _first_step_world_size(chain_path: Path) -> int | None:
    """dp * tp * pp of the chain file's first step (None when the file does not say; loading the chain
    later names what is wrong with it)."""
    try:
        step = json.loads(chain_path.read_text())["steps"][0]
        return int(step.get("dp", 1)) * int(step.get("tp", 1)) * int(step.get("pp", 1))
    except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None


def online_run(flags: Any) -> OnlineRun:
    """``cona train --gpus N --system S --initial-gbs G0 --max-gbs G (--total-iters I | --total-tokens T |
    --target-ppl P) [--botorch | --exhaustive] [--config] [--device] [--workdir] [--run-name]``."""
    config = run_config(flag(flags, "config"), flag(flags, "device"), flag(flags, "overrides"))
    nodes = placement(flags)
    gpus = nodes.num_nodes * nodes.gpus_per_node if nodes.num_nodes > 1 else flag(flags, "gpus")
    initial_gbs = flag(flags, "initial_gbs")
    required = {"--gpus": gpus, "--system": flag(flags, "system"), "--initial-gbs": initial_gbs}
    missing = [name for name, value in required.items() if value is None]
    if missing:
        raise UsageError(f"cona train (online mode): missing {', '.join(missing)}")
    total_iters, total_tokens, target_ppl = _budget(flags, config.training)
    for name, value in (("--gpus", gpus), ("--initial-gbs", initial_gbs)):
        if int(value) < 1:
            raise UsageError(f"cona train {name}: must be at least 1, got {value}")
    max_gbs = int(flag(flags, "max_gbs")) if flag(flags, "max_gbs") is not None else int(initial_gbs)
    if max_gbs < int(initial_gbs):
        raise UsageError(f"cona train --max-gbs {max_gbs} is below --initial-gbs {initial_gbs}")
    return OnlineRun(
        world_size=int(gpus),
        device_type=device_type(config.training),
        system=flags.system,
        initial_gbs=int(initial_gbs),
        max_gbs=max_gbs,
        total_iters=total_iters,
        total_tokens=total_tokens,
        target_ppl=target_ppl,
        botorch=botorch_choice(flags),
        nodes=nodes,
        prior_on_host=True,
        **_common(flags, config, flag(flags, "run_name") or "online", nodes.num_nodes),
    )


NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")
"""One directory per GPU, with its model name in ``information`` (read without starting CUDA)."""


def system_warning(run: OnlineRun) -> str | None:
    """Why the run's ``--system`` does not describe the devices it trains on, if it does not
    (:func:`cona.planner.systems.devices_mismatch`)."""
    return devices_mismatch(load_system(run.system), run.device_type, node_gpu_names())


def node_gpu_names(root: Path = NVIDIA_GPUS) -> list[str]:
    """The model names of this node's NVIDIA GPUs as the driver lists them (empty where it does not)."""
    names = []
    for information in sorted(root.glob("*/information")):
        try:
            lines = information.read_text(errors="replace").splitlines()
        except OSError:
            continue
        names += [line.split(":", 1)[1].strip() for line in lines if line.startswith("Model:")]
    return names


def _budget(flags: Any, training: TrainingConfig) -> tuple[int | None, int | None, float | None]:
    """``--total-iters``, ``--total-tokens`` and ``--target-ppl``, checked (one of them is required)."""
    given = (flag(flags, "total_iters"), flag(flags, "total_tokens"), flag(flags, "target_ppl"))
    if all(value is None for value in given):
        raise UsageError("cona train (online mode): give --total-iters, --total-tokens or --target-ppl")
    total_iters = _positive(given[0], "--total-iters", int)
    total_tokens = _positive(given[1], "--total-tokens", int)
    target_ppl = _positive(given[2], "--target-ppl", float)
    if target_ppl is not None and target_ppl <= 1.0:
        raise UsageError(f"cona train --target-ppl: a perplexity is above 1, got {given[2]}")
    if total_iters is None and total_tokens is None and training.lr.lr_decay_tokens is None:
        raise UsageError(
            "cona train --target-ppl without --total-iters/--total-tokens trains at most to the LR horizon: "
            "set training.lr_decay_tokens in the config"
        )
    return total_iters, total_tokens, target_ppl


def _positive(value: Any, name: str, kind: type) -> Any:
    if value is None:
        return None
    converted = kind(value)
    if converted <= 0:
        raise UsageError(f"cona train {name}: must be positive, got {value}")
    return converted


def fixed_strategy(flags: Any) -> tuple[ConaConfig, Strategy]:
    """The config and strategy of ``cona train --dp D --tp T --pp P --gbs G --mbs M --iters N [--workdir W]``
    (the caller checked that the flags are all given)."""
    if flags.iters <= 0:
        raise UsageError(f"cona train: --iters must be positive, got {flags.iters}")
    workdir(flags)
    config = run_config(flag(flags, "config"), flag(flags, "device"), flag(flags, "overrides"))
    strategy = strategy_from_flags(flags, config)
    check_run_size(config, strategy.gbs, flags.iters)
    return config, strategy


MAX_EPOCHS = 1000
"""A fixed run may go over its train split at most this many times: beyond that ``--gbs x --iters`` is a
typo (``--iters 2**63-1`` spread the LR warm-up over 2^63 iterations), not a plan."""


def check_run_size(config: ConaConfig, gbs: int, iters: int) -> None:
    """Refuse a batch larger than one epoch of the train split (every step would hold a sample twice) or a
    run over :data:`MAX_EPOCHS` epochs; warn (stderr) when the LR rule scales ``training.base_lr`` to a peak
    of 1 or more at ``gbs`` (far outside any rule's calibrated range: ``--gbs 2**40`` gave LR 371)."""
    from cona.data.gpt_dataset import train_samples_per_epoch
    from cona.planner.lr_scaling import scaled_lr

    epoch = train_samples_per_epoch(config)
    if epoch and gbs > epoch:
        raise UsageError(
            f"cona train --gbs {gbs}: more than the {epoch} samples of one epoch of the train split "
            f"({config.training.data.data_prefix}); every step would repeat samples"
        )
    if epoch and gbs * iters > MAX_EPOCHS * epoch:
        raise UsageError(
            f"cona train --gbs {gbs} x --iters {iters} = {gbs * iters} samples: over {MAX_EPOCHS} epochs of "
            f"the train split ({epoch} samples each); lower --iters"
        )
    lr = scaled_lr(config.training, gbs)
    if lr.lr >= 1.0:
        print(
            f"cona: warning: --gbs {gbs} scales training.base_lr {config.training.lr.base_lr:g} by "
            f"{lr.factor:.4g} ({config.training.lr.lr_scale_strategy}) to a peak LR of {lr.lr:.4g}; set "
            "training.lr_scale_lr_cap or a gbs nearer training.base_gbs",
            file=sys.stderr,
        )


def fixed_run(flags: Any, config: ConaConfig, strategy: Strategy) -> FixedRun:
    """The fixed strategy's run on this node (which needs a GPU per process on CUDA)."""
    return FixedRun(
        strategy=strategy,
        iters=flags.iters,
        config=config,
        workdir=workdir(flags),
        device_type=device_type(config.training, processes=strategy.world_size),
        run_name=flag(flags, "run_name"),
        base_port=resolve_port_base(flag(flags, "master_port_base"), num_nodes=1),
        quiet=bool(flag(flags, "quiet")),
        fresh=bool(flag(flags, "fresh")),
        resume_diverged=bool(flag(flags, "resume_diverged")),
    )


def strategy_from_flags(flags: Any, config: ConaConfig) -> Strategy:
    """The flags' degrees and batch sizes; how to run them (zero stage, schedule, ...) from the config."""
    return configured_strategy(
        config.training, dp=flags.dp, tp=flags.tp, pp=flags.pp, mbs=flags.mbs, gbs=flags.gbs
    )
