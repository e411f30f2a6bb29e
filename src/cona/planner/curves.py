"""Measured statistical curves: eval loss against consumed tokens of fixed-gbs runs, and what they imply.

A curves file (JSON, written by ``bench/stat_curves.py``) holds one curve per global batch size, all trained
from the same initialisation with the same seed, LR rule and token-based LR schedule: at each evaluation the
consumed tokens, the eval loss and the noise scale the run's tracker reported there (null while it had
none). The tokens one gbs needs to go from one loss to the next do not depend on the hardware, so the
curves measured on one GPU (gradient accumulation makes any gbs possible) give every cluster the statistical
side of the time to a target; the performance model gives the other side (:mod:`cona.planner.simulate`).

The curves are read on a ladder of losses from the highest loss every curve has evaluated at (its first
evaluation or later) down to the target: ``tokens_to_losses`` gives the consumed tokens at which each curve's
best-so-far eval loss first reaches each level, interpolated linearly between evaluations. A chain that
trains gbs ``a`` to a loss and continues at ``b`` is assumed to need, from there, the tokens ``b``'s own run
needed between the same losses (the assumption of the paper's optimum and of every progress-based chain).

File layout::

    {"kind": "cona statistical curves", "synthetic": false, "base_gbs": 8,
     "model": {"layers": 12, "hidden": 768, "heads": 12, "seq": 512, "vocab_size": 50304},
     "recorded": {"card": "...", "date": "...", "command": "..."},
     "curves": [{"gbs": 16, "tokens": [...], "eval_loss": [...], "noise_scale": [... or null]}, ...]}
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cona.config import ModelConfig
from cona.errors import PlanError, not_found
from cona.planner.efficiency import NoiseScaleEstimate

KIND = "cona statistical curves"
MODEL_KEYS = tuple(field.name for field in dataclasses.fields(ModelConfig))
NOISE_SAMPLES = 64
"""Measurements an estimate read from a curve counts as (the policy needs its ``min_measurements``; the file
keeps the noise scale only, which the tracker reported once it had enough)."""


@dataclass(frozen=True, kw_only=True)
class Curve:
    """One fixed-gbs run: eval loss and the tracker's noise scale (nan: none yet) at consumed tokens."""

    gbs: int
    tokens: np.ndarray
    eval_loss: np.ndarray
    noise_scale: np.ndarray

    def tokens_to_losses(self, levels: np.ndarray) -> np.ndarray:
        """Consumed tokens at which the best-so-far eval loss first reaches each level (inf: never)."""
        best = np.minimum.accumulate(self.eval_loss)
        out = np.full(len(levels), np.inf)
        for index, level in enumerate(levels):
            reached = np.flatnonzero(best <= level)
            if reached.size == 0:
                continue
            i = int(reached[0])
            if i == 0 or best[i] == best[i - 1]:
                out[index] = self.tokens[i]
                continue
            share = (best[i - 1] - level) / (best[i - 1] - best[i])
            out[index] = self.tokens[i - 1] + share * (self.tokens[i] - self.tokens[i - 1])
        return out

    def noise_at(self, tokens: float) -> NoiseScaleEstimate | None:
        """What the run's tracker reported at its last evaluation at or before ``tokens`` (None: nothing)."""
        seen = np.flatnonzero(self.tokens <= tokens)
        if seen.size == 0 or not math.isfinite(self.noise_scale[seen[-1]]):
            return None
        return NoiseScaleEstimate(
            grad_sqr=1.0, trace_sigma=float(self.noise_scale[seen[-1]]), samples=NOISE_SAMPLES
        )


@dataclass(frozen=True, kw_only=True)
class StatCurves:
    """The curves of one model, by increasing gbs."""

    model: ModelConfig
    base_gbs: int
    curves: tuple[Curve, ...]
    synthetic: bool
    recorded: dict[str, Any]
    source: str

    @property
    def gbs(self) -> tuple[int, ...]:
        return tuple(curve.gbs for curve in self.curves)

    def curve(self, gbs: int) -> Curve:
        for curve in self.curves:
            if curve.gbs == gbs:
                return curve
        raise PlanError(f"{self.source}: no curve at gbs {gbs} (it has {', '.join(map(str, self.gbs))})")

    def ladder(self, target_loss: float, segments: int) -> np.ndarray:
        """``segments + 1`` losses from the highest one every curve evaluated at down to ``target_loss``."""
        lowest = min(float(np.min(c.eval_loss)) for c in self.curves)
        if target_loss < lowest:
            raise PlanError(
                f"{self.source}: no curve reaches the target loss {target_loss:.4g} (lowest {lowest:.4g}); "
                "choose a higher --target-loss / --target-ppl"
            )
        start = min(float(c.eval_loss[0]) for c in self.curves)
        if target_loss >= start:
            raise PlanError(
                f"{self.source}: the target loss {target_loss:.4g} is above the first evaluation's "
                f"({start:.4g}); nothing to plan"
            )
        return np.linspace(start, target_loss, segments + 1)


def load_curves(path: str | Path) -> StatCurves:
    """Read and check a curves file; every error names the file and the key (plain JSON: nothing runs)."""
    path = Path(path)
    if not path.is_file():
        raise PlanError(f"--curves: {path} {not_found(path)}")
    try:
        raw = json.loads(path.read_bytes().decode("utf-8", errors="replace"))
    except json.JSONDecodeError as err:
        raise PlanError(f"--curves: {path}: not valid JSON: {err.msg} at line {err.lineno}") from None
    return parse_curves(raw, source=str(path))


def parse_curves(raw: Any, *, source: str) -> StatCurves:
    def fail(key: str, why: str) -> PlanError:
        return PlanError(f"curves {source}: {key}: {why}")

    if not isinstance(raw, dict) or raw.get("kind") != KIND:
        raise fail("kind", f"must be {KIND!r} (is this a curves file from bench/stat_curves.py?)")
    model_raw = raw.get("model")
    if not isinstance(model_raw, dict) or any(key not in MODEL_KEYS for key in model_raw):
        raise fail("model", f"must be an object with keys among {', '.join(MODEL_KEYS)}")
    try:
        model = ModelConfig(**model_raw)
    except (TypeError, ValueError) as err:
        raise fail("model", str(err)) from None
    base_gbs = raw.get("base_gbs")
    if isinstance(base_gbs, bool) or not isinstance(base_gbs, int) or base_gbs < 1:
        raise fail("base_gbs", "must be a positive integer")
    entries = raw.get("curves")
    if not isinstance(entries, list) or not entries:
        raise fail("curves", "must be a non-empty list")
    curves = sorted((_curve(entry, f"curves[{i}]", fail) for i, entry in enumerate(entries)), key=_gbs)
    if len({c.gbs for c in curves}) != len(curves):
        raise fail("curves", "two curves have the same gbs")
    recorded = raw.get("recorded", {})
    if not isinstance(recorded, dict):
        raise fail("recorded", "must be an object")
    synthetic = raw.get("synthetic")
    if not isinstance(synthetic, bool):
        raise fail("synthetic", "must be true or false")
    return StatCurves(
        model=model, base_gbs=base_gbs, curves=tuple(curves), synthetic=synthetic, recorded=recorded,
        source=source,
    )  # fmt: skip


def _gbs(curve: Curve) -> int:
    return curve.gbs


def _curve(entry: Any, key: str, fail) -> Curve:
    if not isinstance(entry, dict):
        raise fail(key, "must be an object")
    gbs = entry.get("gbs")
    if isinstance(gbs, bool) or not isinstance(gbs, int) or gbs < 1:
        raise fail(f"{key}.gbs", "must be a positive integer")
    columns = {}
    for name in ("tokens", "eval_loss", "noise_scale"):
        values = entry.get(name)
        ok = (
            isinstance(values, list)
            and values
            and all(v is None or (isinstance(v, int | float) and not isinstance(v, bool)) for v in values)
        )
        if not ok:
            raise fail(f"{key}.{name}", "must be a non-empty list of numbers")
        column = np.asarray([math.nan if v is None else v for v in values], dtype=np.float64)
        if name != "noise_scale" and not np.all(np.isfinite(column)):
            raise fail(f"{key}.{name}", "must hold finite numbers (null only in noise_scale)")
        columns[name] = column
    if not len(columns["tokens"]) == len(columns["eval_loss"]) == len(columns["noise_scale"]):
        raise fail(key, "tokens, eval_loss and noise_scale must have the same length")
    if columns["tokens"][0] <= 0 or np.any(np.diff(columns["tokens"]) <= 0):
        raise fail(f"{key}.tokens", "must be positive and increasing")
    if np.any(columns["noise_scale"] < 0):
        raise fail(f"{key}.noise_scale", "must not be negative")
    return Curve(gbs=gbs, **columns)


def curves_json(
    model: dict[str, Any],
    base_gbs: int,
    curves: list[dict[str, Any]],
    *,
    synthetic: bool,
    recorded: dict[str, Any],
) -> dict[str, Any]:
    """A curves file's content (``curves``: ``{"gbs", "tokens", "eval_loss", "noise_scale"}`` each)."""
    return {
        "kind": KIND, "synthetic": synthetic, "base_gbs": base_gbs, "model": model, "recorded": recorded,
        "curves": sorted(curves, key=lambda curve: curve["gbs"]),
    }  # fmt: skip
