"""Where the repository, the worker scripts and the recorded run directory are, for tests in any folder."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository's root (examples/, data/, bench/ and src/ are under it)."""

WORKERS = Path(__file__).resolve().parent / "workers"
"""The worker scripts; a run whose stages start ``worker_module="<name>"`` needs this folder on PYTHONPATH."""

RUN_CHAIN_SMALL = Path(__file__).resolve().parent / "fixtures" / "run_chain_small"
"""A small recorded run directory (three stages of a chain) for the report and status tests; rebuilt by
``fixtures/make_run_chain_small.py``."""
