"""Benchmark subprocesses: pinned to a core, in their own process group, with their CPU time read from /proc.

Imports nothing from `gateway`; everything is spoken to over HTTP.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

REPO_ROOT = Path(__file__).resolve().parent.parent
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class ProcessStartError(RuntimeError):
    """A benchmark process exited or never answered; the message carries its log's tail."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


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


def tree_cpu_seconds(pid: int) -> tuple[float, float]:
    """(utime, stime) summed over `pid` and its descendants, in seconds; a process that exits while it is read
    (a replaced worker) counts what it spent until then, or nothing."""
    user = system = 0.0
    for member in process_tree(pid):
        try:
            u, s = cpu_seconds(member)
        except OSError:
            continue
        user, system = user + u, system + s
    return user, system


def tree_run_queue_wait_seconds(pid: int) -> float:
    """run_queue_wait_seconds summed over `pid` and its descendants (each worker's event loop)."""
    total = 0.0
    for member in process_tree(pid):
        try:
            total += run_queue_wait_seconds(member)
        except OSError:
            continue
    return total


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


class BenchProcess:
    """One subprocess, optionally pinned with `taskset -c CORE`, output to a log file, stopped by process group."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        core: int | None,
        env: Mapping[str, str] | None = None,
        inherit: bool = True,
    ) -> None:
        self.name = name
        self._argv = (["taskset", "-c", str(core)] if core is not None else []) + list(argv)
        # `inherit=False`: `env` is the whole environment, not additions to this process's.
        self._env = {**(os.environ if inherit else {}), **(env or {})}
        self._log = tempfile.NamedTemporaryFile(prefix=f"loadtest-{name}-", suffix=".log", delete=False)
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        """The process id (taskset execs the command, so this is the command's own pid)."""
        if self._process is None:
            raise ProcessStartError(f"{self.name} is not started")
        return self._process.pid

    def start(self) -> None:
        """Spawn in a new session (own process group) so `stop` reaches every child."""
        self._process = subprocess.Popen(
            self._argv,
            cwd=REPO_ROOT,
            env=self._env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def poll(self) -> int | None:
        """The exit code once the process has exited, else None (also None before `start`)."""
        return None if self._process is None else self._process.poll()

    def log_tail(self, size: int = 2000) -> str:
        """The end of the process's output."""
        self._log.flush()
        data = Path(self._log.name).read_bytes()
        return data[-size:].decode("utf-8", "replace")

    def wait_http(self, url: str, within: float = 20.0) -> None:
        """Poll `url` until it answers 200; ProcessStartError if the process exits or time runs out."""
        deadline = time.monotonic() + within
        while True:
            if self._process is not None and self._process.poll() is not None:
                raise ProcessStartError(f"{self.name} exited with {self._process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(url, timeout=1.0) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() >= deadline:
                raise ProcessStartError(f"{self.name} did not answer {url} within {within:g} s:\n{self.log_tail()}")
            time.sleep(0.05)

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM the process group, wait up to `grace`, then SIGKILL it."""
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            pgid = process.pid  # start_new_session: the group id is the leader's pid
            os.killpg(pgid, signal.SIGTERM)
            try:
                process.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(pgid, signal.SIGKILL)
                process.wait(grace)
        self._log.close()
        Path(self._log.name).unlink(missing_ok=True)
        self._process = None

    def __enter__(self) -> BenchProcess:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


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
