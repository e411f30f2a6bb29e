"""The Python API: train under a chain of strategies, read what the run did, load what it saved.

``cona.train(config, chain=FILE)``, ``cona.train(config, online=Online(...))`` and
``cona.train(config, fixed=Fixed(...))`` run what ``cona train --chain``, online mode and a fixed strategy
run (:func:`cona.commands.train_modes.run_training`, the same function under the command line): worker
processes under torchrun, CPU processes with gloo or GPUs with NCCL, resumable by the same call after a
crash or a stop. Each returns a :class:`TrainResult` read from the run directory; :func:`load_model` turns a
checkpoint into the model as a plain ``torch.nn.Module``. Settings are refused with the one line
``cona train`` prints for its flag of the same name (``max_gbs`` is ``--max-gbs``), as a :class:`ConaError`.

Nothing here imports torch, numpy or the runner until it is called: ``import cona`` stays cheap.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Literal

from cona import run_files
from cona.errors import UsageError

if TYPE_CHECKING:
    from torch import nn

SEARCHES = ("auto", "botorch", "exhaustive")


@dataclass(frozen=True, kw_only=True)
class Online:
    """Online strategy chaining: ``cona train --gpus --system --initial-gbs [--max-gbs] (--total-iters |
    --total-tokens | --target-ppl)``."""

    gpus: int
    """Processes of every stage: GPUs, or CPU workers."""
    system: str
    """The system description the performance model plans for (``cona systems`` lists them)."""
    initial_gbs: int
    max_gbs: int | None = None
    """The largest gbs a switch may reach (None: ``initial_gbs``)."""
    total_iters: int | None = None
    total_tokens: int | None = None
    target_ppl: float | None = None
    search: Literal["auto", "botorch", "exhaustive"] = "auto"
    """How each gbs's best strategy is found: ``auto`` by the size of the space."""


@dataclass(frozen=True, kw_only=True)
class Fixed:
    """One fixed strategy: ``cona train --dp --tp --pp --gbs --mbs --iters``."""

    gbs: int
    mbs: int
    iters: int
    dp: int = 1
    tp: int = 1
    pp: int = 1


@dataclass(frozen=True, kw_only=True)
class Stage:
    """One stage of a run as its metrics show it."""

    number: int
    dp: int
    tp: int
    pp: int
    mbs: int
    gbs: int
    first_iteration: int
    last_iteration: int
    tokens: int
    """Tokens the stage consumed."""
    tokens_per_s: float | None
    """Its measured rate: the median of its steady log intervals (the first, which holds its start-up, left
    out), as the policy and the console's summary take it."""
    eval_ppl: float | None
    """Its last evaluation's perplexity, None when it evaluated none."""
    stopped: str | None
    """Why it ended (``completed``, ``switch_requested``, ``switch_in_place``); None while it runs."""

    @property
    def strategy(self) -> str:
        return f"dp{self.dp} tp{self.tp} pp{self.pp} mbs{self.mbs} gbs{self.gbs}"


@dataclass(frozen=True, kw_only=True)
class TrainResult:
    """What a run did, read from its run directory (:meth:`read` reads any, finished or not)."""

    run_dir: Path
    stages: tuple[Stage, ...]
    final_loss: float | None
    """The training loss (nats/token) of the last logged iteration."""
    final_perplexity: float | None
    """The perplexity of the last evaluation (``training.eval_interval``), None when there was none."""
    iterations: int
    tokens: int
    checkpoint: Path | None
    """The newest checkpoint a finished stage saved (what :func:`load_model` loads), None when none did."""
    realized_chain: Path | None
    """The chain file of the strategies the run took: ``cona.train(config, chain=result.realized_chain)``
    (``cona train --chain``) trains them again (an online run's ``realized_chain.json``, a chain's own file);
    None until an online run has finished, and for a fixed run (its strategy is its chain)."""

    @classmethod
    def read(cls, run_dir: Path | str) -> TrainResult:
        from cona.runner.views.report import load_run, stage_summaries

        run = load_run(Path(run_dir))
        last = run.records[-1] if run.records else None
        evaluated = [record.eval_ppl for record in run.records if record.eval_ppl is not None]
        finished = run.state.last_finished if run.state is not None else None
        return cls(
            run_dir=run.run_dir.resolve(),
            stages=tuple(_stage(summary) for summary in stage_summaries(run)),
            final_loss=float(last.loss) if last is not None else None,
            final_perplexity=float(evaluated[-1]) if evaluated else None,
            iterations=int(last.iteration) if last is not None else 0,
            tokens=int(last.consumed_tokens) if last is not None else 0,
            checkpoint=Path(finished.checkpoint) if finished and finished.checkpoint else None,
            realized_chain=_realized_chain(run.run_dir, run.state),
        )


def _stage(summary: Any) -> Stage:
    """A stage summary of the report (:func:`cona.runner.views.report.stage_summaries`) as a stage."""
    return Stage(
        number=summary.stage,
        **{key: summary.strategy[key] for key in ("dp", "tp", "pp", "mbs", "gbs")},
        first_iteration=summary.first_iteration,
        last_iteration=summary.last_iteration,
        tokens=summary.end_tokens - summary.start_tokens,
        tokens_per_s=summary.tokens_per_s,
        eval_ppl=summary.last_eval_ppl,
        stopped=summary.reason,
    )


def _realized_chain(run_dir: Path, state: Any) -> Path | None:
    from cona.runner.chain_file import FIXED_ORIGIN
    from cona.runner.state import ONLINE_CHAIN

    realized = run_dir / run_files.REALIZED_CHAIN
    if realized.is_file():
        return realized.resolve()
    if state is None or state.chain_path in (ONLINE_CHAIN, FIXED_ORIGIN):
        return None
    return Path(state.chain_path)  # as the run recorded it (cona.train records it absolute)


def train(
    config: str | Path | None = None,
    *,
    chain: str | Path | None = None,
    online: Online | Mapping[str, Any] | None = None,
    fixed: Fixed | Mapping[str, Any] | None = None,
    gpus: int | None = None,
    workdir: str | Path | None = None,
    run_name: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    device: Literal["auto", "cpu", "cuda"] | None = None,
    fresh: bool = False,
    quiet: bool = False,
    switch_in_place: bool = False,
    restart_workers: bool = False,
) -> TrainResult:
    """Train ``config`` (a ``.conaconfig`` file; None: the one found from the current directory) through a
    ``chain`` file, by ``online`` strategy chaining or under one ``fixed`` strategy (exactly one of them),
    and return what the run did. Checkpoints go under ``workdir`` (default: the current directory), the
    run directory under ``training.log_root``; the same call after a crash or a stop resumes the run
    (``fresh``: start it over). ``gpus``: the processes of a chain's stages (default on a CPU: as many as
    its first step uses). ``overrides``: config keys by ``section.key``, as ``--set`` takes them. ``quiet``:
    no live progress lines. ``switch_in_place`` and ``restart_workers``: as ``cona train``'s flags."""
    from cona.commands.train_modes import run_training

    settings = _settings(chain, online, fixed, gpus)
    settings.update(
        config=None if config is None else str(config),
        overrides=[f"{key}={json.dumps(value)}" for key, value in (overrides or {}).items()],
        workdir=None if workdir is None else Path(workdir),
        run_name=run_name,
        device=device,
        fresh=fresh,
        quiet=quiet,
        switch_in_place=switch_in_place,
        restart_workers=restart_workers,
    )
    run_dir = run_training(SimpleNamespace(**settings))
    assert run_dir is not None, "the native backend's modes name their run directory"
    return TrainResult.read(run_dir)


def _settings(
    chain: str | Path | None,
    online: Online | Mapping[str, Any] | None,
    fixed: Fixed | Mapping[str, Any] | None,
    gpus: int | None,
) -> dict[str, Any]:
    """The mode's settings under ``cona train``'s flag names; one mode, its keys checked."""
    given = [name for name, value in (("chain", chain), ("online", online), ("fixed", fixed)) if value]
    if len(given) != 1:
        which = f"got {' and '.join(f'{name}=' for name in given)}" if given else "got none"
        raise UsageError(f"cona.train: give one of chain=, online= or fixed= ({which})")
    if chain is not None:
        return {"chain": Path(chain).absolute(), "gpus": gpus}
    if gpus is not None:
        raise UsageError(f"cona.train: gpus= goes with chain=; {given[0]}= says its own processes")
    if online is not None:
        settings = asdict(_typed(Online, online, "online"))
        search = settings.pop("search")
        if search not in SEARCHES:
            raise UsageError(f"cona.train online=: search {search!r} is not one of {', '.join(SEARCHES)}")
        return settings | {
            "botorch": search == "botorch" or None,
            "no_botorch": search == "exhaustive" or None,
        }
    return asdict(_typed(Fixed, fixed, "fixed"))


def _typed(kind: type, value: Any, name: str) -> Any:
    """``value`` as ``kind`` (a mapping of its fields is converted), else one line naming ``name=``."""
    if isinstance(value, kind):
        return value
    if not isinstance(value, Mapping):
        raise UsageError(f"cona.train {name}=: expected cona.{kind.__name__} or a dict, got {value!r}")
    unknown = sorted(set(value) - {field.name for field in fields(kind)})
    if unknown:
        raise UsageError(
            f"cona.train {name}=: unknown key {', '.join(unknown)} (cona.{kind.__name__}'s fields)"
        )
    try:
        return kind(**value)
    except TypeError as err:
        raise UsageError(f"cona.train {name}=: {err}") from None


def load_model(path: str | Path, *, device: str = "cpu") -> nn.Module:
    """The model a checkpoint holds, in eval mode on ``device``: ``model(tokens)`` gives logits over the
    padded vocabulary, ``model.config`` is its model section. ``path``: a checkpoint (a ``global_step``
    directory, a layout directory with a ``latest`` marker, the marker itself) or a run directory (its
    newest checkpoint). Weights of any layout load whole into this one process, verified."""
    from cona.engine.checkpoint.info import read_checkpoint_info, resolve_checkpoint
    from cona.engine.checkpoint.load import load_model_tensors
    from cona.engine.model import GPT

    checkpoint = resolve_checkpoint(_checkpoint_of(Path(path)))
    info = read_checkpoint_info(checkpoint)
    model = GPT(info.config.model)
    model.load_state_dict(load_model_tensors(checkpoint))
    return model.to(device).eval()


def _checkpoint_of(path: Path) -> Path:
    """A run directory's newest checkpoint; any other path as it is."""
    if not run_files.runner_state_path(path).is_file():
        return path
    checkpoint = TrainResult.read(path).checkpoint
    if checkpoint is None:
        raise UsageError(f"cona.load_model: run directory {path} holds no finished stage's checkpoint yet")
    return checkpoint
