"""SYNTHETIC statistical curves for tests (not measured): a loss falling as a power of the progress and a
noise scale growing as the loss falls, each gbs's tokens from McCandlish et al.'s efficiency
``(phi + M0) / (phi + M)``. Marked ``"synthetic": true`` in the file they make."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from cona.planner.curves import curves_json

MODEL = {"name": "gpt-125m", "layers": 12, "hidden": 768, "heads": 12, "seq": 512, "vocab_size": 50304}


def synthetic_curves(
    gbs_list=(16, 32, 64, 128, 256, 512),
    *,
    base_gbs: int = 8,
    seq: int = 512,
    progress_tokens: float = 4e7,
    eval_every_tokens: float = 262_144,
    noise_start: float = 8.0,
    noise_end: float = 1500.0,
) -> dict:
    """The curves file's content: each gbs evaluated every ``eval_every_tokens`` until it has made
    ``progress_tokens`` of base-batch progress; the noise scale (samples) grows from ``noise_start`` to
    ``noise_end`` over that progress."""
    progress = np.linspace(0.0, progress_tokens, 20_001)
    fraction = progress / progress_tokens
    loss = 2.5 + 8.3 * (1.0 + progress / 5e4) ** -0.5
    noise = noise_start * (noise_end / noise_start) ** fraction
    curves = []
    for gbs in gbs_list:
        per_progress = (noise + gbs) / (noise + base_gbs)
        tokens = np.concatenate([[0.0], np.cumsum(per_progress[1:] * np.diff(progress))])
        evals = np.arange(eval_every_tokens, tokens[-1], eval_every_tokens)
        at = np.interp(evals, tokens, progress)
        curves.append(
            {
                "gbs": gbs,
                "tokens": evals.tolist(),
                "eval_loss": np.interp(at, progress, loss).tolist(),
                "noise_scale": np.interp(at, progress, noise).tolist(),
            }
        )
    recorded = {"card": "none (synthetic)", "date": "none", "command": "tests/helpers/synthetic_curves.py"}
    return curves_json(dict(MODEL, seq=seq), base_gbs, curves, synthetic=True, recorded=recorded)


def write_synthetic_curves(path: Path, **kwargs) -> Path:
    path.write_text(json.dumps(synthetic_curves(**kwargs)))
    return path
