"""The chain file (``--chain FILE``): a fixed sequence of strategies, validated before anything runs.

It imports none of the runner's modules and no torch: ``cona plan`` (which checks the chain it writes) and
the run descriptions (:mod:`cona.runner.run_descriptions`) read chain files without the rest of the runner.

A chain file is JSON with ``steps`` (one object per stage) and optional ``pruning`` entries::

    {"steps": [{"step_num": 1, "dp": 2, "tp": 1, "pp": 2, "gbs": 8, "mbs": 2, "train_iters": 200,
                "is_initial": true, "convert": true},
               {"step_num": 2, "dp": 4, "tp": 1, "pp": 1, "gbs": 16, "mbs": 4, "extra_iters": 200,
                "load_dp": 2, "load_tp": 1, "load_pp": 2}],
     "pruning": [{"stage": 1, "ckpt_dir": "checkpoints/gpt/z1/bf16/tp1_pp2_dp2_sp1", "mode": "keep-latest"}]}

Every error is a :class:`ChainError` whose one line names the file, the step and the key.

A pruning entry's ``ckpt_dir`` names the layout of stage ``stage`` as the seed's chain files do,
``checkpoints/<model.name>/z<zero>/<dtype>/tp<tp>_pp<pp>_dp<dp>_sp1`` relative to the workdir (a chain file
does not know the name of the run it will be run as); what is pruned is that run's own folder of the layout,
``<workdir>/checkpoints/<run_name>/<model.name>/...`` (:mod:`cona.engine.checkpoint.paths`).

Which pruning entries are safe (the rule :func:`_check_pruning` enforces): pruning after stage ``k`` runs
once stage ``k`` is trained and (if ``convert``) published, before stage ``k+1`` starts, and it only ever
removes ``*_universal`` directories of stage ``k``'s own layout directory. The only checkpoint that exists
at that moment and that a later stage still needs is the one stage ``k+1`` loads: ``latest_universal`` of
stage ``k``'s layout when stage ``k`` converts (otherwise stage ``k+1`` loads the plain ``global_step``
directory, which pruning never touches). Every later stage loads a checkpoint written after the pruning.
So ``keep-latest`` (which keeps exactly what ``latest_universal`` names) is always safe, and ``delete-all``
is refused after a converting stage that has a successor. It stays useful after the last stage, or after a
stage that does not convert, to drop older universal copies left in a layout directory that stages share.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from cona.config import ConaConfig
from cona.config.fields import reject_unknown
from cona.engine.checkpoint.info import read_checkpoint_info, resolve_checkpoint
from cona.engine.checkpoint.paths import CHECKPOINTS, layout_name
from cona.errors import ChainError, CheckpointError, ConaError
from cona.layout_rules import LayoutSizes, check_layout
from cona.strategy import Strategy, configured_strategy

PRUNE_MODES = ("keep-latest", "delete-all")
STOP_KEYS = ("train_iters", "extra_iters", "target_iters")
LAYOUT_KEYS = ("dp", "tp", "pp")
STEP_INT_KEYS = ("step_num", "dp", "tp", "pp", "gbs", "mbs", *STOP_KEYS, "load_dp", "load_tp", "load_pp")
STEP_KEYS = (*STEP_INT_KEYS, "is_initial", "convert", "load_checkpoint")
PRUNE_KEYS = ("stage", "ckpt_dir", "mode")
TOP_KEYS = ("steps", "pruning")
FIXED_ORIGIN = "fixed"
"""The origin of a fixed run's chain (``cona train --dp .. --iters N``): one initial step built in memory
from the strategy, named so in the run state (where a chain file's path stands otherwise)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ChainStep:
    """One stage of a chain: a strategy and how long to train under it."""

    step_num: int
    """Stage number (1, 2, 3, ...); names the stage in logs and derives its master port."""
    dp: int
    tp: int
    pp: int
    gbs: int
    """Global batch size in samples."""
    mbs: int
    """Micro-batch size per data-parallel rank."""
    train_iters: int | None = None
    """Absolute horizon: train until the run's iteration counter reaches this (Megatron's --train-iters)."""
    extra_iters: int | None = None
    """Train this many iterations past the iteration of the checkpoint the stage loads."""
    target_iters: int | None = None
    """The absolute iteration to stop at (the same stop as train_iters, spelled as the runner's target)."""
    is_initial: bool = False
    """The first stage: starts from scratch instead of loading a checkpoint."""
    load_dp: int | None = None
    load_tp: int | None = None
    load_pp: int | None = None
    """The layout the previous stage saved under (checked against it when given)."""
    convert: bool = False
    """Publish this stage's checkpoint as ``global_step<N>_universal`` with a ``latest_universal`` marker."""
    load_checkpoint: str | None = None
    """The initial step only: start from this checkpoint (another run's, to continue or fine-tune it;
    absolute or relative to the workdir) at its iteration and consumed samples, instead of from scratch."""

    def target_iteration(self, start_iteration: int) -> int:
        """The absolute iteration this stage stops at, given the iteration of the checkpoint it loads."""
        if self.extra_iters is not None:
            return start_iteration + self.extra_iters
        absolute = self.train_iters if self.train_iters is not None else self.target_iters
        assert absolute is not None, "validation guarantees exactly one stop key"
        return absolute

    def strategy(self, config: ConaConfig) -> Strategy:
        return configured_strategy(
            config.training, dp=self.dp, tp=self.tp, pp=self.pp, mbs=self.mbs, gbs=self.gbs
        )

    @property
    def layout(self) -> str:
        """The layout directory's name, ``tp<tp>_pp<pp>_dp<dp>_sp1``."""
        return Strategy(dp=self.dp, tp=self.tp, pp=self.pp, mbs=self.mbs, gbs=self.gbs).layout


@dataclass(frozen=True, kw_only=True, slots=True)
class PruneRule:
    """Remove universal copies from one layout directory after a stage."""

    stage: int
    """The step_num after which to prune."""
    ckpt_dir: str
    """The step's layout as the chain file names it: ``checkpoints/<model.name>/z<zero>/<dtype>/<layout>``
    relative to the workdir (or that path absolute); the run prunes its own folder of that layout."""
    mode: Literal["keep-latest", "delete-all"]
    """keep-latest keeps only the directory latest_universal names; delete-all removes every one."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ChainConfig:
    """A whole validated chain: a chain file's, or a fixed run's one step."""

    steps: tuple[ChainStep, ...]
    pruning: tuple[PruneRule, ...] = ()
    origin: str = "<chain>"
    """What the chain came from, as messages and the run state name it: the chain file's path, or
    :data:`FIXED_ORIGIN` for a fixed run's one step (built in memory from its strategy)."""
    digest: str = ""
    """sha256 of the file's JSON content (key order and whitespace ignored): identifies the chain of a run."""
    step_digests: tuple[str, ...] = ()
    """The same of each step's entry: which steps an edit after a crash changed."""
    start_checkpoint: Path | None = None
    """The checkpoint the initial step loads (its ``load_checkpoint``, resolved); None: from scratch."""
    start_iteration: int = 0
    start_tokens: int = 0
    """The iteration and consumed tokens the chain starts at (those of ``start_checkpoint``)."""

    def rules_after(self, step_num: int) -> tuple[PruneRule, ...]:
        return tuple(rule for rule in self.pruning if rule.stage == step_num)


def layout_relpath(config: ConaConfig, step: ChainStep, dtype: str) -> Path:
    """``checkpoints/<model.name>/z<zero>/<dtype>/tp<tp>_pp<pp>_dp<dp>_sp1``: how a pruning entry's
    ``ckpt_dir`` names the step's layout (relative to the workdir, as the seed's chain files do; the run's
    own folder of that layout, under ``checkpoints/<run_name>/``, is what it prunes)."""
    return Path(CHECKPOINTS) / layout_name(config, step.strategy(config), dtype)


def content_digest(raw: Any) -> str:
    """A hash of decoded JSON that ignores key order and whitespace."""
    return hashlib.sha256(json.dumps(raw, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def load_chain(
    path: Path | str, *, config: ConaConfig, world_size: int, dtype: str, workdir: Path
) -> ChainConfig:
    """Read and validate a chain file for ``config`` on ``world_size`` processes, checkpoints in ``dtype``."""
    chain_path = Path(path)
    try:
        raw = json.loads(chain_path.read_text())
    except FileNotFoundError:
        raise ChainError(f"chain file {chain_path} does not exist") from None
    except IsADirectoryError:
        raise ChainError(f"--chain {chain_path} is a directory; give the chain's JSON file") from None
    except UnicodeDecodeError:
        raise ChainError(f"{chain_path}: not a UTF-8 JSON chain file") from None
    except OSError as err:
        raise ChainError(f"cannot read chain file {chain_path}: {err.strerror}") from None
    except json.JSONDecodeError as err:
        raise ChainError(f"{chain_path}: not valid JSON: {err.msg} at line {err.lineno}") from None
    return parse_chain(
        raw, source=chain_path, config=config, world_size=world_size, dtype=dtype, workdir=workdir
    )


def parse_chain(
    raw: Any, *, source: Path | str | None, config: ConaConfig, world_size: int, dtype: str, workdir: Path
) -> ChainConfig:
    """Validate decoded chain JSON; ``source`` (the file, or :data:`FIXED_ORIGIN`) names it in errors."""
    where = str(source) if source is not None else "<chain>"
    if not isinstance(raw, dict):
        raise ChainError(f"{where}: the top level must be an object with 'steps' (and optionally 'pruning')")
    reject_unknown(raw, TOP_KEYS, where, error=ChainError)
    raw_steps = raw.get("steps")
    if not isinstance(raw_steps, list) or not raw_steps:
        raise ChainError(f"{where}: 'steps' must be a non-empty list of stage objects")
    steps = tuple(_parse_step(item, index, where) for index, item in enumerate(raw_steps))
    start = start_point([step.load_checkpoint for step in steps], workdir, where)
    _check_sequence(steps, where, start_iteration=start[1])
    for previous, step in zip((None, *steps), steps, strict=False):
        _check_step_layout(step, previous, config, world_size, where)
    raw_rules = raw.get("pruning", [])
    if not isinstance(raw_rules, list):
        raise ChainError(f"{where}: 'pruning' must be a list of objects")
    rules = tuple(_parse_rule(item, index, where) for index, item in enumerate(raw_rules))
    for index, rule in enumerate(rules):
        _check_pruning(rule, index, steps, config, dtype, workdir, where)
    return ChainConfig(
        steps=steps,
        pruning=rules,
        origin=where,
        digest=content_digest(raw),
        step_digests=tuple(content_digest(item) for item in raw_steps),
        start_checkpoint=start[0],
        start_iteration=start[1],
        start_tokens=start[2],
    )


def _parse_step(item: Any, index: int, where: str) -> ChainStep:
    label = f"{where}: steps[{index}]"
    if not isinstance(item, dict):
        raise ChainError(f"{label}: must be an object, got {json.dumps(item)}")
    if isinstance(item.get("step_num"), int):
        label += f" (step_num {item['step_num']})"
    reject_unknown(item, STEP_KEYS, label, error=ChainError)
    for key in STEP_INT_KEYS:
        if key in item and item[key] is not None:
            _expect_positive_int(item[key], f"{label}: {key}")
    for key in ("is_initial", "convert"):
        if key in item and not isinstance(item[key], bool):
            raise ChainError(f"{label}: {key}: expected true or false, got {json.dumps(item[key])}")
    if not isinstance(item.get("load_checkpoint", ""), str):
        raise ChainError(
            f"{label}: load_checkpoint: expected a path, got {json.dumps(item['load_checkpoint'])}"
        )
    for key in ("step_num", *LAYOUT_KEYS, "gbs", "mbs"):
        if item.get(key) is None:
            raise ChainError(f"{label}: missing required key '{key}'")
    given = [key for key in STOP_KEYS if item.get(key) is not None]
    if len(given) != 1:
        found = f"got {', '.join(given)}" if given else "got none"
        raise ChainError(
            f"{label}: exactly one of train_iters, extra_iters, target_iters is required; {found}"
        )
    return ChainStep(**{key: value for key, value in item.items() if value is not None})


def _expect_positive_int(value: Any, label: str) -> None:
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        raise ChainError(f"{label}: expected an integer, got the string {value!r}; drop the quotes")
    if not isinstance(value, int) or isinstance(value, bool):
        raise ChainError(f"{label}: expected an integer, got {json.dumps(value)}")
    if value <= 0:
        raise ChainError(f"{label}: must be positive, got {value}")


def _step_label(where: str, step: ChainStep) -> str:
    return f"{where}: step {step.step_num}"


def start_point(loads: list[str | None], workdir: Path, where: str) -> tuple[Path | None, int, int]:
    """Where a chain starts: from scratch, or from the checkpoint its initial step loads (another run's, to
    continue or fine-tune it). The checkpoint, iteration and consumed tokens the chain starts from, given
    each step's ``load_checkpoint`` (only the first may have one; a relative path is relative to the
    workdir)."""
    for number, given in enumerate(loads[1:], start=2):
        if given is not None:
            raise ChainError(
                f"{where}: step {number}: load_checkpoint: only the initial step loads a given checkpoint "
                "(the others load the previous step's)"
            )
    if loads[0] is None:
        return None, 0, 0
    path = Path(loads[0]) if Path(loads[0]).is_absolute() else Path(workdir) / loads[0]
    try:
        checkpoint = resolve_checkpoint(path)
        state = read_checkpoint_info(checkpoint).trainer_state
    except CheckpointError as err:
        raise ChainError(f"{where}: step 1: load_checkpoint: {err}") from None
    return checkpoint, int(state.get("iteration", 0)), int(state.get("consumed_tokens", 0))


def _check_sequence(steps: tuple[ChainStep, ...], where: str, *, start_iteration: int = 0) -> None:
    for index, step in enumerate(steps):
        if step.step_num != index + 1:
            raise ChainError(
                f"{where}: steps[{index}]: step_num: expected {index + 1} (stages count 1, 2, 3, ... "
                f"in file order), got {step.step_num}"
            )
    initial = [step.step_num for step in steps if step.is_initial]
    if not steps[0].is_initial:
        raise ChainError(
            f"{_step_label(where, steps[0])}: is_initial: the first step must set is_initial true "
            f"(it starts from scratch, or from its load_checkpoint)"
        )
    if len(initial) > 1:
        raise ChainError(
            f"{_step_label(where, steps[initial[1] - 1])}: is_initial: only the first step may be "
            f"initial (found is_initial on steps {', '.join(map(str, initial))})"
        )
    previous_end = start_iteration
    for step in steps:
        # extra_iters always moves forward; an absolute stop at or before the previous stop trains nothing.
        end = step.target_iteration(previous_end)
        if end <= previous_end:
            key = "train_iters" if step.train_iters is not None else "target_iters"
            raise ChainError(
                f"{_step_label(where, step)}: {key}: {end} is not past the iteration the previous "
                f"stage stops at ({previous_end}); use extra_iters for a count"
            )
        previous_end = end


def _check_step_layout(
    step: ChainStep, previous: ChainStep | None, config: ConaConfig, world_size: int, where: str
) -> None:
    label = _step_label(where, step)
    if step.dp * step.tp * step.pp != world_size:
        raise ChainError(
            f"{label}: dp*tp*pp = {step.dp}*{step.tp}*{step.pp} = {step.dp * step.tp * step.pp} "
            f"does not match the {world_size} processes of this run (--gpus, or --num-nodes x "
            f"--gpus-per-node)"
        )
    for key in LAYOUT_KEYS:
        load_value = getattr(step, f"load_{key}")
        if load_value is None:
            continue
        if previous is None:
            raise ChainError(f"{label}: load_{key}: the initial step loads nothing; remove load_dp/tp/pp")
        if load_value != getattr(previous, key):
            raise ChainError(
                f"{label}: load_{key}: {load_value} is not the layout step {previous.step_num} "
                f"saves under ({key}={getattr(previous, key)})"
            )
    try:
        validate_layout(config, step.strategy(config), world_size)
    except ConaError as err:
        raise ChainError(f"{label}: {err}") from None


def validate_layout(config: ConaConfig, strategy: Strategy, world_size: int) -> None:
    """The layout rules the workers check too. Where the vocabulary is not known yet (no vocab file), the
    padded-vocabulary check is left to the training command, which refuses such a config anyway."""
    model = config.model
    if model.vocab_size is None:
        model = dataclasses.replace(model, vocab_size=model.make_vocab_size_divisible_by)
    check_layout(LayoutSizes.of_config(model), strategy, world_size)


def _parse_rule(item: Any, index: int, where: str) -> PruneRule:
    label = f"{where}: pruning[{index}]"
    if not isinstance(item, dict):
        raise ChainError(f"{label}: must be an object, got {json.dumps(item)}")
    reject_unknown(item, PRUNE_KEYS, label, error=ChainError)
    for key in PRUNE_KEYS:
        if key not in item:
            raise ChainError(f"{label}: missing required key '{key}'")
    _expect_positive_int(item["stage"], f"{label}: stage")
    if not isinstance(item["ckpt_dir"], str) or not item["ckpt_dir"].strip():
        raise ChainError(f"{label}: ckpt_dir: expected a path string, got {json.dumps(item['ckpt_dir'])}")
    if item["mode"] not in PRUNE_MODES:
        raise ChainError(f"{label}: mode: {json.dumps(item['mode'])} is not 'keep-latest' or 'delete-all'")
    return PruneRule(stage=item["stage"], ckpt_dir=item["ckpt_dir"], mode=item["mode"])


def resolve_ckpt_dir(ckpt_dir: str, workdir: Path) -> Path:
    """A pruning ``ckpt_dir`` as an absolute path (relative ones are relative to the workdir)."""
    path = Path(ckpt_dir).expanduser()
    return Path(workdir, path).resolve() if not path.is_absolute() else path.resolve()


def _check_pruning(
    rule: PruneRule,
    index: int,
    steps: tuple[ChainStep, ...],
    config: ConaConfig,
    dtype: str,
    workdir: Path,
    where: str,
) -> None:
    label = f"{where}: pruning[{index}] (stage {rule.stage})"
    if rule.stage > len(steps):
        raise ChainError(f"{label}: stage: there is no step {rule.stage} (the chain has {len(steps)})")
    step = steps[rule.stage - 1]
    expected = layout_relpath(config, step, dtype)
    if resolve_ckpt_dir(rule.ckpt_dir, workdir) != (Path(workdir) / expected).resolve():
        raise ChainError(
            f"{label}: ckpt_dir: {rule.ckpt_dir!r} is not the layout directory of step {step.step_num}"
            f" ({expected}, relative to the workdir)"
        )
    if rule.mode == "delete-all" and step.convert and step.step_num < len(steps):
        raise ChainError(
            f"{label}: mode: delete-all would remove the universal checkpoint step "
            f"{step.step_num + 1} loads (step {step.step_num} converts); use keep-latest"
        )


def planned_iterations(chain: ChainConfig) -> list[tuple[int, int]]:
    """(start, end) iteration of every stage when each stage reaches its stop (as a chain always does)."""
    spans, end = [], chain.start_iteration
    for step in chain.steps:
        start, end = end, step.target_iteration(end)
        spans.append((start, end))
    return spans


def planned_tokens(chain: ChainConfig, seq: int) -> int:
    """Tokens the whole chain trains on, counted from the start of training (a loaded checkpoint's tokens
    included): the horizon of its LR schedule."""
    return chain.start_tokens + sum(
        (end - start) * step.gbs * seq
        for step, (start, end) in zip(chain.steps, planned_iterations(chain), strict=True)
    )
