"""``cona report``'s whole job: load the runs, draw the figures, write ``index.html``.

Apart from :mod:`cona.runner.views.report` (what the figures and the page read from a run directory), which
the
figure and page modules import, so nothing imports back.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cona.errors import ConaError
from cona.runner.views.report import RunData, load_run
from cona.runner.views.report_figures import draw_all
from cona.runner.views.report_html import write_html


@dataclass(frozen=True, kw_only=True)
class ReportResult:
    out_dir: Path
    html: Path
    figures: tuple[Path, ...]
    warnings: tuple[str, ...]


def build_report(
    run_dirs: Sequence[Path], out_dir: Path | None = None, *, warn: Callable[[str], None] | None = None
) -> ReportResult:
    """Figures and ``index.html`` for one or more run directories (several: overlaid, one colour each)."""
    if not run_dirs:
        raise ConaError("cona report: name at least one run directory")
    runs = distinct_names([load_run(Path(run_dir)) for run_dir in run_dirs])
    out = Path(out_dir) if out_dir is not None else runs[0].run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    figures = draw_all(runs, out)
    warnings = tuple(warning for run in runs for warning in run.warnings)
    html = write_html(runs, figures, out, warnings)
    for warning in warnings:
        (warn or _stderr)(f"warning: {warning}")
    return ReportResult(out_dir=out, html=html, figures=tuple(figures.values()), warnings=warnings)


def distinct_names(runs: Sequence[RunData]) -> list[RunData]:
    """The runs, those whose names clash renamed ``<ancestor>/<name>`` by the nearest directory above them
    whose name tells them apart (two log roots' ``dp1``: their parents; three demos' ``logs/online``:
    their time-stamped directories)."""
    named = []
    for run in runs:
        twins = [other.run_dir.resolve() for other in runs if other.name == run.name]
        if len(twins) < 2:
            named.append(run)
            continue
        ancestors = run.run_dir.resolve().parents
        depth = next(
            (
                level
                for level in range(len(ancestors))
                if _ancestor_names(twins, level).count(ancestors[level].name) == 1
            ),
            0,
        )
        named.append(dataclasses.replace(run, name=f"{ancestors[depth].name}/{run.name}"))
    return named


def _ancestor_names(paths: Sequence[Path], level: int) -> list[str]:
    return [path.parents[level].name if level < len(path.parents) else "" for path in paths]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)
