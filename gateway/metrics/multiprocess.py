"""The metrics directory several gateway worker processes share, so one scrape of any of them counts them all.

prometheus_client's multiprocess mode: every worker writes its values to files in one directory, and /metrics
sums them (`exposition.Exposition`). The library picks the mode when it is first imported, so `shared_metrics`
runs before the serving modules are imported; it empties the directory at start and removes a private one at
exit, and `forget_worker` drops a dead worker's live gauges (its counters stay: what it counted happened).
Imports settings and supervisor.state (pid_alive) only; never prometheus_client (that would fix the mode too early).
"""

from __future__ import annotations

import contextlib
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from gateway.engine.supervisor_state import pid_alive
from gateway.settings import metrics_dir, share_metrics


@contextlib.contextmanager
def shared_metrics(workers: int) -> Iterator[Path | None]:
    """With more than one worker: a fresh metrics directory for this run (the operator's
    PROMETHEUS_MULTIPROC_DIR, emptied, or a private one, removed at the end); with one, nothing."""
    if workers <= 1:
        yield None
        return
    given = metrics_dir()
    directory = given if given is not None else Path(tempfile.mkdtemp(prefix="nemotron-gateway-metrics-"))
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob("*.db"):  # a previous run's values must not be added to this one's
        stale.unlink(missing_ok=True)
    share_metrics(directory)
    try:
        yield directory
    finally:
        if given is None:
            shutil.rmtree(directory, ignore_errors=True)
            share_metrics(None)


def forget_worker(pid: int) -> None:
    """Drop the live gauges (in-flight requests) of a worker that has exited, as prometheus_client's
    `mark_process_dead` does: a gauge summed over live processes must not keep a dead one's value."""
    directory = metrics_dir()
    if directory is None:
        return
    for path in directory.glob(f"gauge_live*_{pid}.db"):
        path.unlink(missing_ok=True)


_PID = re.compile(r"_(\d+)\.db$")


def living_workers(directory: Path) -> list[int]:
    """The processes that wrote to `directory` and are still running (their pid ends each file's name)."""
    pids = {int(found.group(1)) for path in directory.glob("*.db") if (found := _PID.search(path.name))}
    return sorted(pid for pid in pids if pid_alive(pid))
