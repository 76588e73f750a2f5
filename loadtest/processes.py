"""Processes started by a benchmark or a test: in their own process group, pinned to a core, CPU time from /proc.

`LoggedProcess` is the synchronous runner of the load tool and of the test suite (tests/procs.py builds on it): the
command in a new session, its output into a log file, stopped by process group. It lives here, not in the gateway
package, because no product code starts a server this way: the supervisor runs the engine under its reaper
(`gateway.supervisor.process.GuardedProcess`). The processes it starts are spoken to over HTTP only; nothing here
imports the gateway.
"""

from __future__ import annotations

import contextlib
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
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

__all__ = [
    "BenchProcess",
    "LoggedProcess",
    "ProcessStartError",
    "can_pin",
    "cpu_seconds",
    "free_port",
    "http_status",
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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


# Straight to the address, whatever proxy the environment names: these URLs are local servers.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_status(url: str, timeout: float = 1.0) -> int | None:
    """The status `url` answers a GET with, or None when nothing answers in `timeout` seconds."""
    try:
        with _DIRECT.open(url, timeout=timeout) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as error:
        return int(error.code)
    except (urllib.error.URLError, OSError):
        return None


class ProcessStartError(RuntimeError):
    """A process exited before it was ready, or was not ready in time; the message carries its log's tail."""


class LoggedProcess:
    """`argv` in a new session (its own process group), stdout and stderr into a temporary log file.

    `stop` signals the whole group: SIGTERM, up to `grace` seconds for the command to exit, then SIGKILL. It can
    be started again after a stop (a new log each time). `with LoggedProcess(argv) as proc:` starts and stops it.
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        name: str | None = None,
    ) -> None:
        self.argv = [str(arg) for arg in argv]
        self.env = dict(env) if env is not None else None
        self.cwd = Path(cwd) if cwd is not None else None
        # Named in messages and the log file's name: the module of `python -m MODULE`, else the program.
        module = self.argv[self.argv.index("-m") + 1] if "-m" in self.argv[:-1] else None
        self.name = name or module or Path(self.argv[0]).name
        self.returncode: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_path: Path | None = None
        self._final_log: str | None = None

    @property
    def pid(self) -> int:
        """The command's pid, also its process group's id."""
        if self._proc is None:
            raise ProcessStartError(f"{self.name} is not started")
        return self._proc.pid

    @property
    def running(self) -> bool:
        """Whether the command has started and not exited."""
        return self._proc is not None and self._proc.poll() is None

    def poll(self) -> int | None:
        """The exit code once the command has exited, else None (also None before `start`)."""
        return None if self._proc is None else self._proc.poll()

    def start(self) -> Self:
        """Spawn the command in a new session, its output into a new log file."""
        fd, path = tempfile.mkstemp(prefix=f"{self.name}-", suffix=".log")
        self._log_path, self._final_log, self.returncode = Path(path), None, None
        try:
            self._proc = subprocess.Popen(
                self.argv,
                cwd=self.cwd,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=fd,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            os.close(fd)
        return self

    def wait_until_ready(
        self, url: str | None, within: float, *, status: int = 200, check: Callable[[], bool] | None = None
    ) -> None:
        """Block until `check()` holds (if given) and `url` answers `status` (if given); ProcessStartError when the
        command exits first or `within` seconds pass."""
        deadline = time.monotonic() + within
        while True:
            if self._proc is None or self._proc.poll() is not None:
                code = None if self._proc is None else self._proc.returncode
                raise ProcessStartError(f"{self.name} exited with {code} before ready:\n{self.tail()}")
            if (check is None or check()) and (url is None or http_status(url) == status):
                return
            if time.monotonic() >= deadline:
                what = f"did not answer {url} with {status}" if url else "was not ready"
                raise ProcessStartError(f"{self.name} {what} within {within:g} s:\n{self.tail()}")
            time.sleep(0.05)

    def send_signal(self, sig: int) -> None:
        """Signal the whole process group (nothing once the command has exited: its id may be reused)."""
        if self.running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, sig)

    def stop(self, grace: float = 5.0) -> int | None:
        """SIGTERM the group, wait up to `grace` s for the command, then SIGKILL the group; the exit code."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            self.send_signal(signal.SIGTERM)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if proc is not None:
            self.returncode = proc.returncode
        if self._log_path is not None and self._final_log is None:
            self._final_log = self._log_path.read_text(errors="replace")
            self._log_path.unlink(missing_ok=True)
        return self.returncode

    def log_text(self) -> str:
        """Everything the command wrote to stdout and stderr so far (kept after `stop`)."""
        if self._final_log is not None:
            return self._final_log
        return "" if self._log_path is None else self._log_path.read_text(errors="replace")

    def tail(self, lines: int = 50) -> str:
        """The last `lines` lines of the log."""
        return "\n".join(self.log_text().splitlines()[-lines:])

    def __enter__(self) -> Self:
        if self._proc is None:
            self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class BenchProcess(LoggedProcess):
    """The process runner (`LoggedProcess`), optionally pinned with `taskset -c CORE`, run from the
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
