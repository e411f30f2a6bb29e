"""The options of an online run (``cona train --gpus N --system S --initial-gbs G0 ...``), checked."""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cona.config import ConaConfig, load_config
from cona.errors import ConaError
from cona.runner.chain import content_digest
from cona.runner.chain_options import PLACEMENT_FLAGS
from cona.runner.launch import DEFAULT_MASTER_PORT_BASE, resolve_port_base
from cona.runner.multinode import NodePlacement, resolve_placement
from cona.runner.run_dir import check_run_name, check_workdir, resolve_log_root


@dataclass(frozen=True, kw_only=True)
class OnlineRun:
    """What ``cona train`` in online mode was asked to do."""

    config: ConaConfig
    workdir: Path
    run_dir: Path
    world_size: int
    device_type: str
    system: str
    initial_gbs: int
    max_gbs: int
    total_iters: int | None = None
    total_tokens: int | None = None
    target_ppl: float | None = None
    botorch: bool = True
    base_port: int | None = DEFAULT_MASTER_PORT_BASE
    """Stage N rendezvous on port ``base_port + N``; None: torchrun picks a free port (one node only)."""
    fresh: bool = False
    quiet: bool = False
    policy_overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    """PolicySettings fields to override (tests and the demo), e.g. ``{"hysteresis": 0.0}``."""
    noise_scale_floor: float | None = None
    """Decide as if the noise scale were at least this (samples); every decision logs both numbers. For
    the demo and tests: a short run of a tiny model measures a noise scale far below where a switch pays."""
    nodes: NodePlacement = NodePlacement()
    """Where this node stands in a multi-node run (one node by default); node 0 searches and decides."""

    def mode_args(self) -> list[str]:
        """The flags that decide this run's stages, for the runners node 0 starts on the other hosts."""
        args = [
            "--system",
            self.system,
            "--initial-gbs",
            str(self.initial_gbs),
            "--max-gbs",
            str(self.max_gbs),
        ]
        for flag, value in (
            ("--total-iters", self.total_iters),
            ("--total-tokens", self.total_tokens),
            ("--target-ppl", self.target_ppl),
        ):
            if value is not None:
                args += [flag, str(value)]
        return args + ([] if self.botorch else ["--no-botorch"])

    def identity(self) -> str:
        """A digest of what decides the run's stages: a run directory is only continued with the same."""
        keys = ("system", "initial_gbs", "max_gbs", "total_iters", "total_tokens", "target_ppl", "botorch")
        chosen = {key: getattr(self, key) for key in keys}
        return content_digest(chosen | {"policy": self.policy_overrides, "floor": self.noise_scale_floor})

    @property
    def planned_tokens(self) -> int:
        """The LR schedule's horizon: the token budget, else training.lr_decay_tokens, else the tokens of
        --total-iters at the initial gbs (a larger gbs later ends the cosine early; set lr_decay_tokens)."""
        training = self.config.training
        if self.total_tokens is not None:
            return self.total_tokens
        if training.lr_decay_tokens is not None:
            return training.lr_decay_tokens
        assert self.total_iters is not None, "online_run_from_args requires a budget"
        return self.total_iters * self.initial_gbs * self.config.model.seq


def online_run_from_args(args: argparse.Namespace) -> OnlineRun:
    """Options from ``cona train --gpus N --system S --initial-gbs G0 --max-gbs G (--total-iters I |
    --total-tokens T | --target-ppl P) [--no-botorch] [--config] [--device] [--workdir] [--run-name]``."""
    config = resolve_log_root(load_config(getattr(args, "config", None), check_data_files=True))
    if getattr(args, "device", None) is not None:
        config = dataclasses.replace(
            config, training=dataclasses.replace(config.training, device=args.device)
        )
    nodes = resolve_placement({name: getattr(args, name, None) for name in PLACEMENT_FLAGS}, os.environ)
    gpus = nodes.num_nodes * nodes.gpus_per_node if nodes.num_nodes > 1 else args.gpus
    required = {"--gpus": gpus, "--system": args.system, "--initial-gbs": args.initial_gbs}
    missing = [flag for flag, value in required.items() if value is None]
    if missing:
        raise ConaError(f"cona train (online mode): missing {', '.join(missing)}")
    budget = (args.total_iters, args.total_tokens, args.target_ppl)
    if all(value is None for value in budget):
        raise ConaError("cona train (online mode): give --total-iters, --total-tokens or --target-ppl")
    total_iters = _positive(args.total_iters, "--total-iters", int)
    total_tokens = _positive(args.total_tokens, "--total-tokens", int)
    target_ppl = _positive(args.target_ppl, "--target-ppl", float)
    if target_ppl is not None and target_ppl <= 1.0:
        raise ConaError(f"cona train --target-ppl: a perplexity is above 1, got {args.target_ppl}")
    if total_iters is None and total_tokens is None and config.training.lr_decay_tokens is None:
        raise ConaError(
            "cona train --target-ppl without --total-iters/--total-tokens trains at most to the LR horizon: "
            "set training.lr_decay_tokens in the config"
        )
    for flag, value in (("--gpus", gpus), ("--initial-gbs", args.initial_gbs)):
        if int(value) < 1:
            raise ConaError(f"cona train {flag}: must be at least 1, got {value}")
    max_gbs = int(args.max_gbs) if args.max_gbs is not None else int(args.initial_gbs)
    if max_gbs < int(args.initial_gbs):
        raise ConaError(f"cona train --max-gbs {max_gbs} is below --initial-gbs {args.initial_gbs}")
    device_type = _device_type(config)
    run_name = check_run_name(getattr(args, "run_name", None) or "online")
    return OnlineRun(
        config=config,
        workdir=check_workdir(Path(getattr(args, "workdir", None) or Path.cwd())),
        run_dir=Path(config.training.log_root) / run_name,
        world_size=int(gpus),
        device_type=device_type,
        system=args.system,
        initial_gbs=int(args.initial_gbs),
        max_gbs=max_gbs,
        total_iters=total_iters,
        total_tokens=total_tokens,
        target_ppl=target_ppl,
        botorch=not getattr(args, "no_botorch", False),
        base_port=resolve_port_base(getattr(args, "master_port_base", None), nodes.num_nodes),
        fresh=bool(getattr(args, "fresh", False)),
        quiet=bool(getattr(args, "quiet", False)),
        nodes=nodes,
    )


def _positive(value: Any, flag: str, kind: type) -> Any:
    if value is None:
        return None
    converted = kind(value)
    if converted <= 0:
        raise ConaError(f"cona train {flag}: must be positive, got {value}")
    return converted


def _device_type(config: ConaConfig) -> str:
    if config.training.device != "auto":
        return config.training.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
