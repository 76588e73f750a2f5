"""A live progress bar on stderr (rich): requests done of the bound, errors, running p50/p99 latency and TTFT.

Without rich (the `loadtest` extra not installed) or with `enabled=False` it shows nothing.
Imports nothing from `gateway`.
"""

from __future__ import annotations

import bisect
import math
import time
from types import TracebackType

from loadtest.timing import RequestTiming

try:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
except ImportError:  # the `loadtest` extra is missing: no bar
    _HAVE_RICH = False
else:
    _HAVE_RICH = True

_REFRESH_S = 0.25


class LiveProgress:
    """Counts finished requests and keeps sorted latencies so the live percentiles cost O(1) to read."""

    def __init__(self, label: str, total: int, *, enabled: bool = True) -> None:
        self._label = label
        self._total = total
        self._enabled = enabled and _HAVE_RICH
        self._latencies: list[float] = []
        self._ttfts: list[float] = []
        self._errors = 0
        self._shown = 0.0
        self._progress: Progress | None = None
        self._task: TaskID | None = None

    def __enter__(self) -> LiveProgress:
        if self._enabled:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[live]}"),
                console=Console(stderr=True),
                refresh_per_second=4,
            )
            self._progress.start()
            self._task = self._progress.add_task(self._label, total=self._total, live="")
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._progress is not None:
            self._show(force=True)
            self._progress.stop()
            self._progress = None

    def record(self, record: RequestTiming) -> None:
        """Count one finished request."""
        if record.ok:
            bisect.insort(self._latencies, record.latency)
            if record.ttft is not None:
                bisect.insort(self._ttfts, record.ttft)
        else:
            self._errors += 1
        self._show()

    def live_text(self) -> str:
        """The running figures shown beside the bar."""
        parts = [f"lat p50 {_at(self._latencies, 0.5)} p99 {_at(self._latencies, 0.99)}"]
        if self._ttfts:
            parts.append(f"ttft p50 {_at(self._ttfts, 0.5)} p99 {_at(self._ttfts, 0.99)}")
        parts.append(f"errors {self._errors}")
        return " | ".join(parts)

    def _show(self, force: bool = False) -> None:
        if self._progress is None or self._task is None:
            return
        now = time.monotonic()
        done = len(self._latencies) + self._errors
        if force or now - self._shown >= _REFRESH_S:
            self._shown = now
            self._progress.update(self._task, completed=done, live=self.live_text())


def _at(ordered: list[float], q: float) -> str:
    if not ordered:
        return "-"
    value = ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))] * 1000
    return f"{value:.0f} ms" if value >= 10 else f"{value:.1f} ms"
