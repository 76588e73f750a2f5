"""Benchmark subprocesses: pinned to a core, in their own process group, with their CPU time read from /proc.

The runner is the project's own (`gateway.supervisor.process.LoggedProcess`, which the tests use too); the
processes it starts are spoken to over HTTP only.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from gateway.supervisor.process import LoggedProcess, ProcessStartError, free_port

__all__ = [
    "BenchProcess",
    "ProcessStartError",
    "can_pin",
    "cpu_seconds",
    "free_port",
    "pin_self",
    "python_argv",
    "revision",
    "run_queue_wait_seconds",
    "run_seconds",
]

REPO_ROOT = Path(__file__).resolve().parent.parent
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(utime, stime) of the whole process (all threads) from /proc/<pid>/stat, in seconds (10 ms resolution)."""
    with open(f"/proc/{pid}/stat", "rb") as stat:
        fields = stat.read().rsplit(b")", 1)[1].split()
    # After the ")" closing comm, field 3 (state) is index 0, so utime (14) and stime (15) are 11 and 12.
    return int(fields[11]) / _CLOCK_TICKS, int(fields[12]) / _CLOCK_TICKS


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (a gateway's forked workers), from /proc/<pid>/task/*/children; a process that
    is gone by the time it is read is left out."""
    found, pending = [], [pid]
    while pending:
        current = pending.pop()
        found.append(current)
        try:
            tasks = os.listdir(f"/proc/{current}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{current}/task/{task}/children", "rb") as children:
                    pending.extend(int(child) for child in children.read().split())
            except OSError:
                continue
    return found


def tree_sum(pid: int, read: Callable[[int], float]) -> float:
    """`read` of `pid` and of each of its descendants (a gateway's forked workers), summed; a process that exits
    while it is read (a replaced worker) counts nothing."""
    total = 0.0
    for member in process_tree(pid):
        try:
            total += read(member)
        except OSError:
            continue
    return total


def system_seconds(pid: int) -> float:
    """The system (kernel) part of the process's CPU seconds, from /proc/<pid>/stat (10 ms resolution)."""
    return cpu_seconds(pid)[1]


def run_seconds(pid: int) -> float:
    """CPU seconds (user and system) the process has run, all its threads, ended ones too: its CPU-time clock
    (what clock_getcpuclockid(3) names), the scheduler's nanosecond count. /proc/<pid>/stat counts 10 ms ticks,
    which left a 2 s phase of a proxy spending a fifth of a core some 40 ticks, and the difference of two such
    phases (the per-chunk slope) off by a third. OSError once the process is gone."""
    # Linux's clock id for a process's CPU time: the pid, inverted, shifted past the clock type (2: the scheduler's).
    return time.clock_gettime(((~pid) << 3) | 2)


def run_queue_wait_seconds(pid: int) -> float:
    """Seconds the process's main thread (the event loop) spent runnable but waiting for a CPU.

    From /proc/<pid>/schedstat; it shows how much other load on the same core disturbed a phase.
    """
    with open(f"/proc/{pid}/schedstat", "rb") as schedstat:
        return int(schedstat.read().split()[1]) / 1e9


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
        self,
        name: str,
        argv: Sequence[str],
        *,
        core: int | None,
        env: Mapping[str, str] | None = None,
        inherit: bool = True,
    ) -> None:
        pinned = (["taskset", "-c", str(core)] if core is not None else []) + list(argv)
        # taskset execs the command, so `pid` is the command's own. `inherit=False`: `env` is the whole
        # environment, not additions to this process's.
        super().__init__(pinned, env={**(os.environ if inherit else {}), **(env or {})}, cwd=REPO_ROOT, name=name)

    def log_tail(self, size: int = 2000) -> str:
        """The last `size` characters of the process's output."""
        return self.log_text()[-size:]

    def wait_http(self, url: str, within: float = 20.0) -> None:
        """Poll `url` until it answers 200; ProcessStartError if the process exits or time runs out."""
        self.wait_until_ready(url, within)


def redis_server_binary() -> str:
    """The redis-server executable; SystemExit when none is installed."""
    found = shutil.which("redis-server") or next(
        (p for p in ("/usr/sbin/redis-server", "/usr/bin/redis-server") if os.access(p, os.X_OK)), None
    )
    if found is None:
        raise SystemExit("no redis-server found: install it or pass --redis-url")
    return found


def redis_process(port: int, core: int | None) -> BenchProcess:
    """A private, memory-only redis-server on 127.0.0.1:`port` (a benchmark never touches a shared Redis)."""
    argv = [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    return BenchProcess("redis", argv, core=core)


def wait_redis(port: int, within: float = 20.0) -> None:
    """Poll 127.0.0.1:`port` with PING until Redis answers +PONG; ProcessStartError when time runs out."""
    deadline = time.monotonic() + within
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(64).startswith(b"+PONG"):
                    return
        except OSError:
            pass
        if time.monotonic() >= deadline:
            raise ProcessStartError(f"redis on port {port} did not answer PING within {within:g} s")
        time.sleep(0.05)


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
