"""Benchmark subprocesses: pinned to a core, in their own process group, with their CPU time read from /proc.

The runner is the project's own (`gateway.supervisor.process.LoggedProcess`, which the tests use too); the
processes it starts are spoken to over HTTP only.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from gateway.supervisor.process import LoggedProcess, ProcessStartError, free_port

__all__ = [
    "BenchProcess",
    "ProcessStartError",
    "can_pin",
    "cpu_seconds",
    "free_port",
    "own_cpu_seconds",
    "pin_self",
    "python_argv",
    "revision",
    "run_queue_wait_seconds",
]

REPO_ROOT = Path(__file__).resolve().parent.parent
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(utime, stime) of the whole process (all threads) from /proc/<pid>/stat, in seconds (10 ms resolution)."""
    with open(f"/proc/{pid}/stat", "rb") as stat:
        fields = stat.read().rsplit(b")", 1)[1].split()
    # After the ")" closing comm, field 3 (state) is index 0, so utime (14) and stime (15) are 11 and 12.
    return int(fields[11]) / _CLOCK_TICKS, int(fields[12]) / _CLOCK_TICKS


def run_queue_wait_seconds(pid: int) -> float:
    """Seconds the process's main thread (the event loop) spent runnable but waiting for a CPU.

    From /proc/<pid>/schedstat; it shows how much other load on the same core disturbed a phase.
    """
    with open(f"/proc/{pid}/schedstat", "rb") as schedstat:
        return int(schedstat.read().split()[1]) / 1e9


def own_cpu_seconds() -> tuple[float, float]:
    """This process's (user, system) CPU time, all threads."""
    times = os.times()
    return times.user, times.system


def can_pin() -> bool:
    """Whether pinning to cores 0 and 1 is possible here (taskset exists, two CPUs usable)."""
    return shutil.which("taskset") is not None and len(os.sched_getaffinity(0)) >= 2


def pin_self(core: int) -> None:
    """Pin this process (the load generator) to one core."""
    os.sched_setaffinity(0, {core})


class BenchProcess(LoggedProcess):
    """The project's process runner (`LoggedProcess`), optionally pinned with `taskset -c CORE`, run from the
    repository root; stopped by process group."""

    def __init__(
        self, name: str, argv: Sequence[str], *, core: int | None, env: Mapping[str, str] | None = None
    ) -> None:
        pinned = (["taskset", "-c", str(core)] if core is not None else []) + list(argv)
        # taskset execs the command, so `pid` is the command's own.
        super().__init__(pinned, env={**os.environ, **(env or {})}, cwd=REPO_ROOT, name=name)

    def log_tail(self, size: int = 2000) -> str:
        """The last `size` characters of the process's output."""
        return self.log_text()[-size:]

    def wait_http(self, url: str, within: float = 20.0) -> None:
        """Poll `url` until it answers 200; ProcessStartError if the process exits or time runs out."""
        self.wait_until_ready(url, within)


def python_argv(module: str, *args: str) -> list[str]:
    """`python -m module args...` with this interpreter (the project venv)."""
    return [sys.executable, "-m", module, *args]


def revision() -> str:
    """The commit measured (with `-dirty` when the tree has changes)."""
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"
