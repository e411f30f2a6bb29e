"""Progress over the bytes of an input file: a rich bar on a terminal, plain periodic lines otherwise
(logs and CI), nothing for inputs that finish before a bar would help."""

from __future__ import annotations

import sys
import time
from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

LONG_INPUT_BYTES = 4 << 20  # below this preprocessing takes about a second: no progress display
PLAIN_INTERVAL_S = 10.0


class ByteProgress:
    def __init__(self, description: str, total_bytes: int, *, enabled: bool = True) -> None:
        self._description = description
        self._total = total_bytes
        self._done = 0
        self._documents = 0
        self._active = enabled and total_bytes >= LONG_INPUT_BYTES
        self._console = Console()
        self._bar: Progress | None = None
        self._task = None
        self._last_plain = time.monotonic()

    def __enter__(self) -> ByteProgress:
        if self._active and self._console.is_terminal:
            self._bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                DownloadColumn(),
                TextColumn("{task.fields[documents]} documents"),
                TimeRemainingColumn(),
                console=self._console,
                transient=True,
            )
            self._bar.start()
            self._task = self._bar.add_task(self._description, total=self._total, documents=0)
        return self

    def advance(self, num_bytes: int, *, documents: int) -> None:
        self._done += num_bytes
        self._documents = documents
        if self._bar is not None:
            self._bar.update(self._task, advance=num_bytes, documents=documents)
        elif self._active and time.monotonic() - self._last_plain >= PLAIN_INTERVAL_S:
            self._last_plain = time.monotonic()
            percent = 100.0 * self._done / max(self._total, 1)
            print(
                f"{self._description}: {percent:.0f}% of {self._total / 1e6:.1f} MB, "
                f"{self._documents} documents",
                file=sys.stdout,
                flush=True,
            )

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._bar is not None:
            self._bar.stop()
