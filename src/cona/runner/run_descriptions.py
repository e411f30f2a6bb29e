"""What ``cona train`` was asked to do, one description per mode, made from the flags and checked by
:mod:`cona.commands.train_runs`: a chain file (:class:`ChainRun`; the file's schema is
:mod:`cona.runner.chain_file`), a fixed strategy (:class:`FixedRun`, run as a one-step chain) and an online
run (:class:`OnlineRun`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cona.config import ConaConfig
from cona.runner.chain_file import FIXED_ORIGIN, ChainConfig, content_digest, load_chain, parse_chain
from cona.runner.launch import DEFAULT_MASTER_PORT_BASE
from cona.runner.nodes.multinode import NodePlacement, cona_command
from cona.strategy import Strategy


@dataclass(frozen=True, kw_only=True)
class ChainRun:
    """What ``cona train --chain`` was asked to do, or a fixed strategy as the chain of one step."""

    chain_path: Path | None = None
    """The chain file; None for a fixed run, whose chain is :attr:`fixed_chain`."""
    fixed_chain: dict | None = None
    """A fixed run's chain of one initial step, built in memory from its strategy
    (:func:`cona.runner.fixed.fixed_chain`) and validated as a chain file's content."""
    config: ConaConfig
    workdir: Path
    """Checkpoints go to ``<workdir>/checkpoints/<run_dir.name>/...``."""
    run_dir: Path
    world_size: int
    device_type: str
    """``cpu`` or ``cuda``; decides the checkpoint dtype directory (CPU trains in fp32)."""
    base_port: int | None = DEFAULT_MASTER_PORT_BASE
    """Stage N rendezvous on port ``base_port + N``; None: torchrun picks a free port (one node only)."""
    fresh: bool = False
    """Discard the run directory's state and start the chain over."""
    quiet: bool = False
    """No per-interval console lines from the workers."""
    resume_diverged: bool = False
    """Relaunch a stage whose last attempt stopped because training diverged (else it is refused)."""
    nodes: NodePlacement = NodePlacement()
    """Where this node stands in a multi-node run (one node by default)."""
    switch_in_place: bool = False
    """A step that keeps the previous step's layout continues the state in the workers' memory (when the
    launcher keeps its workers, see :mod:`cona.runner.worker_session`) instead of saving, publishing and
    loading a checkpoint; a layout change always goes through the checkpoint and its verification."""

    def __post_init__(self) -> None:
        assert (self.chain_path is None) != (self.fixed_chain is None), "a chain file or a fixed run's chain"

    def read_chain(self, dtype: str) -> ChainConfig:
        """The validated chain (checkpoints in ``dtype``): the chain file's, or the fixed run's one step."""
        settings = {
            "config": self.config,
            "world_size": self.world_size,
            "dtype": dtype,
            "workdir": self.workdir,
        }
        if self.fixed_chain is not None:
            return parse_chain(self.fixed_chain, source=FIXED_ORIGIN, **settings)
        assert self.chain_path is not None
        return load_chain(self.chain_path, **settings)


def runner_command(run: ChainRun) -> list[str]:
    """The ``cona train`` command of this run, for the runners node 0 starts on the other hosts: ``--chain
    FILE``, or a fixed run's strategy flags, from which each runner builds the same chain."""
    return cona_command(
        _chain_args(run),
        config=run.config,
        nodes=run.nodes,
        run_dir=run.run_dir,
        workdir=run.workdir,
        base_port=run.base_port,
        quiet=run.quiet,
    )


def _chain_args(run: ChainRun) -> list[str]:
    if run.fixed_chain is None:
        assert run.chain_path is not None
        return ["--chain", str(run.chain_path.resolve())]
    (step,) = run.fixed_chain["steps"]
    flags = [arg for key in ("dp", "tp", "pp", "gbs", "mbs") for arg in (f"--{key}", str(step[key]))]
    return [*flags, "--iters", str(step["train_iters"])]


@dataclass(frozen=True, kw_only=True)
class FixedRun:
    """What ``cona train`` with a fixed strategy was asked to do."""

    strategy: Strategy
    iters: int
    """The iteration the stage stops at."""
    config: ConaConfig
    workdir: Path
    """Checkpoints go to ``<workdir>/checkpoints/<run name>/...`` (absolute)."""
    device_type: str
    """``cpu`` or ``cuda``, as the workers will resolve it."""
    run_name: str | None = None
    """The run directory's name under ``training.log_root``; None: the strategy's
    (:func:`cona.runner.fixed.fixed_run_name`)."""
    base_port: int | None = DEFAULT_MASTER_PORT_BASE
    """Stage N rendezvous on port ``base_port + N``; None: torchrun picks a free port (one node only)."""
    quiet: bool = False
    fresh: bool = False
    """Discard what an earlier run of the same name left and start over."""
    resume_diverged: bool = False
    """Relaunch a stage whose last attempt stopped because training diverged (else it is refused)."""


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
    botorch: bool | None = None
    """True: each gbs's best strategy by Bayesian optimisation, False: exhaustively, None: chosen by the
    size of the space (:func:`cona.planner.search_choice.uses_botorch`)."""
    base_port: int | None = DEFAULT_MASTER_PORT_BASE
    """Stage N rendezvous on port ``base_port + N``; None: torchrun picks a free port (one node only)."""
    fresh: bool = False
    quiet: bool = False
    resume_diverged: bool = False
    """Relaunch a stage whose last attempt stopped because training diverged (else it is refused)."""
    policy_overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    """PolicySettings fields to override (tests and the demo), e.g. ``{"hysteresis": 0.0}``."""
    noise_scale_floor: float | None = None
    """Decide as if the noise scale were at least this (samples); every decision logs both numbers. For
    the demo and tests: a short run of a tiny model measures a noise scale far below where a switch pays."""
    nodes: NodePlacement = NodePlacement()
    """Where this node stands in a multi-node run (one node by default); node 0 searches and decides."""
    backend: str = "native"
    """Who trains the stages (``--backend``): its performance profile predicts the candidates."""
    prior_on_host: bool = False
    """On a CPU, fit the planner's prior on the model's steps timed on this host before the first stage is
    chosen (:func:`cona.runner.schedules.frontier.fit_prior_on_host`); ``cona train`` and ``cona demo`` do.
    Off, the prior is the system file's alone (tests that need a prior independent of the host)."""

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
        return args + {None: [], True: ["--botorch"], False: ["--exhaustive"]}[self.botorch]

    def identity(self) -> str:
        """A digest of what decides the run's stages: a run directory is only continued with the same."""
        keys = ("system", "initial_gbs", "max_gbs", "total_iters", "total_tokens", "target_ppl", "botorch")
        chosen = {key: getattr(self, key) for key in keys}
        # another backend is another run; native runs keep the digest they had before backends were chosen
        backend = {"backend": self.backend} if self.backend != "native" else {}
        return content_digest(
            chosen | {"policy": self.policy_overrides, "floor": self.noise_scale_floor} | backend
        )

    @property
    def planned_tokens(self) -> int:
        """The LR schedule's horizon: the token budget, else training.lr_decay_tokens, else the tokens of
        --total-iters at the initial gbs (a larger gbs later ends the cosine early; set lr_decay_tokens)."""
        training = self.config.training
        if self.total_tokens is not None:
            return self.total_tokens
        if training.lr.lr_decay_tokens is not None:
            return training.lr.lr_decay_tokens
        assert self.total_iters is not None, "an online run has a budget"
        return self.total_iters * self.initial_gbs * self.config.model.seq
