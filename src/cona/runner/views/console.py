"""The live console of ``cona train`` and ``cona demo``, driven by the runner from the run's files.

While a stage's workers run, the runner polls (through :func:`cona.runner.launch.run_stage`'s ``watch``)
the lines rank 0 appends to ``metrics.jsonl`` and, in online mode, the search's ``decisions.jsonl``. The
workers' own console lines are switched off (``run_stage(quiet=True)``), so nothing interleaves. Modes:

* ``rich`` (stdout is a terminal): a live panel per stage (progress bar toward the stop rule with the ETA,
  the strategy, loss, eval perplexity, tokens/s, MFU, noise scale, and the best online candidate with how far
  it is from winning), redrawn in place; the runner's messages scroll above it; a summary line stays.
* ``plain`` (stdout is not a terminal, e.g. CI logs): one line per log interval, no cursor control.
* ``quiet`` (``--quiet``): only the runner's stage lines (start, finish, switch) and errors.

``CONA_CONSOLE=rich|plain|quiet`` overrides the choice (tests, or a terminal that should get plain lines).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Literal

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from cona.engine.spec import StageSpec
from cona.errors import ConfigError
from cona.jsonl import JsonlTail
from cona.planner.efficiency import NoiseScaleTracker
from cona.runner.views.console_format import (
    StageSnapshot,
    StopRule,
    candidate_text,
    eta_s,
    format_duration,
    metric_fields,
    plain_line,
    progress_text,
    stage_progress,
    summary_line,
)
from cona.runner.views.report import DECISIONS_FILE, strategy_label

if TYPE_CHECKING:
    from cona.runner.schedules.chain_schedule import Launcher, StageLaunch

CONSOLE_ENV = "CONA_CONSOLE"
Mode = Literal["rich", "plain", "quiet"]
MODES: tuple[Mode, ...] = ("rich", "plain", "quiet")
BAR_WIDTH = 40
Watch = Callable[[], None]


def choose_mode(*, quiet: bool, is_terminal: bool, environ: Mapping[str, str]) -> Mode:
    """``--quiet`` wins; then ``CONA_CONSOLE``; then rich on a terminal and plain elsewhere."""
    if quiet:
        return "quiet"
    override = environ.get(CONSOLE_ENV, "").strip()
    if override:
        if override not in MODES:
            raise ConfigError(f"{CONSOLE_ENV}={override!r}: use one of {', '.join(MODES)}")
        return override  # type: ignore[return-value]  (checked against MODES just above)
    return "rich" if is_terminal else "plain"


class StageMonitor:
    """What the runner has read of one stage so far: its records in ``metrics.jsonl`` from the launch on,
    the run's noise scale and newest evaluation (earlier stages' records count too) and the stage's newest
    online decision."""

    def __init__(self, spec: StageSpec, *, launched_at: float) -> None:
        self.stage = spec.stage
        self.failed: str | None = None
        """Why the display of this stage stopped (it is not retried)."""
        self._metrics = JsonlTail(spec.metrics_path)
        self._tracker = NoiseScaleTracker(base_batch=spec.config.training.lr.base_gbs)
        last_eval = None
        for record in self._metrics.new_records():  # earlier stages and attempts: noise scale, last eval
            self._tracker = self._tracker.update_from_metrics(record)
            last_eval = record if record.get("eval_ppl") is not None else last_eval
        self._decisions = JsonlTail.at_end(spec.run_dir / DECISIONS_FILE)
        self.snapshot = StageSnapshot(
            stage=spec.stage,
            strategy=strategy_label(dataclasses.asdict(spec.strategy)),
            rule=StopRule(target_iteration=spec.target_iteration, max_tokens=spec.max_tokens),
            seq=spec.config.model.seq,
            launched_at=launched_at,
            last_eval=last_eval,
            noise_scale=self._tracker.noise_scale(),
        )

    def poll(self) -> list[tuple[StageSnapshot, dict]]:
        """Read what was appended; returns each new record of this stage with the snapshot as of it."""
        updates = []
        snapshot = self.snapshot
        for record in self._metrics.new_records():
            self._tracker = self._tracker.update_from_metrics(record)
            snapshot = dataclasses.replace(snapshot, noise_scale=self._tracker.noise_scale())
            if record.get("stage") != self.stage or "iteration" not in record:
                continue
            snapshot = dataclasses.replace(
                snapshot,
                first=snapshot.first or record,
                last=record,
                last_eval=record if record.get("eval_ppl") is not None else snapshot.last_eval,
            )
            updates.append((snapshot, record))
        for decision in self._decisions.new_records():
            if decision.get("stage") == self.stage:
                snapshot = dataclasses.replace(snapshot, decision=decision)
        self.snapshot = snapshot
        return updates


def render_stage(snapshot: StageSnapshot, now: float) -> RenderableType:
    """The live panel of a stage: header, bar, metrics and (online) the best candidate."""
    progress = stage_progress(snapshot)
    header = Text.assemble((f"stage {snapshot.stage}", "bold"), "  ", (snapshot.strategy, "cyan"))
    bar_row = Table.grid(padding=(0, 2))
    bar_row.add_column(max_width=BAR_WIDTH)  # the bar gives up width first on a narrow terminal
    for _ in range(3):
        bar_row.add_column(no_wrap=True)
    bar_row.add_row(
        ProgressBar(total=1.0, completed=progress.fraction if progress else 0.0),
        Text(progress_text(progress)),
        Text(f"eta {format_duration(eta_s(snapshot, now))}"),
        Text(f"elapsed {format_duration(now - snapshot.launched_at)}", style="dim"),
    )
    metrics = Text("   ").join(
        Text.assemble((f"{label} ", "dim"), value) for label, value in metric_fields(snapshot)
    )
    parts: list[RenderableType] = [header, bar_row, metrics]
    best = candidate_text(snapshot.decision)
    if best is not None:
        parts.append(Text.assemble(("best: ", "dim"), best))
    return Group(*parts)


class RunConsole:
    """The console of one ``cona train`` or ``cona demo`` run: :meth:`message` is the runner's ``out``,
    :meth:`launcher` wraps the stage launcher, :meth:`stage` watches one stage."""

    def __init__(self, mode: Mode, console: Console, *, clock: Callable[[], float] = time.time) -> None:
        self.mode = mode
        self._console = console
        self._clock = clock
        self._live: Live | None = None

    @classmethod
    def for_stdout(cls, *, quiet: bool, environ: Mapping[str, str] | None = None) -> RunConsole:
        """The console for this process's stdout: rich decides whether it is a terminal."""
        console = Console(highlight=False, soft_wrap=True)
        env = os.environ if environ is None else environ
        return cls(choose_mode(quiet=quiet, is_terminal=console.is_terminal, environ=env), console)

    def message(self, text: str) -> None:
        """A line of the runner (stage planned, published, switched, finished): shown in every mode, above
        the live panel in rich mode."""
        if self.mode == "rich":
            self._console.print(text, markup=False, highlight=False)
        else:
            self._write(text)

    def launcher(self, base: Launcher) -> Launcher:
        """``base`` with this console watching each stage it launches (workers silenced)."""

        def launch(stage: StageLaunch) -> None:
            with self.stage(stage.spec) as watch:
                base(dataclasses.replace(stage, quiet=True, watch=_chain_watches(stage.watch, watch)))

        # What the driver may ask of the launcher it is given: stages in the same processes (in place).
        launch.keeps_workers = getattr(base, "keeps_workers", False)  # type: ignore[attr-defined]
        return launch

    @contextmanager
    def stage(self, spec: StageSpec) -> Iterator[Watch]:
        """Watch one stage while its workers run: yields the ``watch`` for ``run_stage``. The stage's last
        lines are read once the block ends; a summary line follows unless the block raised."""
        monitor = StageMonitor(spec, launched_at=self._clock())
        if self.mode == "rich":
            self._live = Live(
                render_stage(monitor.snapshot, self._clock()),
                console=self._console,
                auto_refresh=False,
                transient=True,
            )
            self._live.start()

        def watch() -> None:
            if monitor.failed is None:
                self._show(monitor)

        try:
            yield watch
            watch()
        finally:
            if self._live is not None:
                self._live.stop()
                self._live = None
        self.message(summary_line(monitor.snapshot, self._clock()))

    def _show(self, monitor: StageMonitor) -> None:
        """Read and show what is new. A failure here stops the display of this stage, never its training
        (``run_stage`` stops the workers when a watch raises)."""
        try:
            self._show_updates(monitor)
        except Exception as err:  # noqa: BLE001 (any display bug must leave the stage running)
            monitor.failed = f"{type(err).__name__}: {err}"
            if self._live is not None:
                self._live.stop()
                self._live = None
            self.message(f"stage {monitor.stage}: live console stopped ({monitor.failed}); training goes on")

    def _show_updates(self, monitor: StageMonitor) -> None:
        updates = monitor.poll()
        if self.mode == "plain":
            for snapshot, record in updates:
                self._write(plain_line(snapshot, record, now=float(record["time"])))
        elif self._live is not None:
            self._live.update(render_stage(monitor.snapshot, self._clock()), refresh=True)

    def _write(self, line: str) -> None:
        """Plain text and a flush per line, so a pipe (CI log) shows every line as it happens."""
        self._console.file.write(line + "\n")
        self._console.file.flush()


def _chain_watches(first: Watch | None, second: Watch) -> Watch:
    """One watch calling both (a multi-node run's check of the other nodes comes first)."""
    if first is None:
        return second

    def both() -> None:
        first()
        second()

    return both
