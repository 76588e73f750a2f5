"""WorkerPool: N gateway processes serving one listening socket; a dead one is replaced, all drain on SIGTERM.

One gateway process relays on one core; past that, more processes. The parent binds the
socket once and forks the workers before any thread or event loop exists (so the fork is safe, and
cheap: the modules are already imported); each worker builds its own app and serves the shared socket,
and the kernel hands each new connection to whichever worker accepts first. Keys and limits live in
Redis, so they hold across workers. Signal handlers only record; the loop acts (uvicorn's
supervisors). Imports nothing of the gateway: `serve` hands it what a worker runs.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from types import FrameType

logger = logging.getLogger(__name__)

# The exit code of a worker whose app could not start: every replacement would fail the same way.
STARTUP_FAILURE = 3
# A worker that dies sooner than this after its start is replaced only after a growing pause (a crash loop
# must not fork hundreds of processes a second); one that lived longer is replaced at once.
_SHORT_LIFE = 5.0
_MAX_PAUSE = 10.0
# How long the pool waits beyond the workers' own drain deadline before it kills what is left.
_KILL_MARGIN = 5.0

_fork = multiprocessing.get_context("fork")
_PR_SET_PDEATHSIG = 1


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask, which taskset and cgroup cpusets narrow)."""
    return len(os.sched_getaffinity(0))


def _die_with(parent: int) -> None:
    # A parent killed outright (SIGKILL, the OOM killer) must not leave its workers serving the port on their
    # own, unsupervised: the kernel then sends each of them SIGTERM, which drains and ends it.
    if sys.platform != "linux":
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # it died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def _run_worker(target: Callable[[socket.socket], int], sock: socket.socket, parent: int) -> None:
    # The parent's record-only handlers were inherited; the worker's server installs its own.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    _die_with(parent)
    sys.exit(target(sock))


class WorkerPool:
    """Keeps `count` worker processes running `target(sock)` until SIGTERM/SIGINT, then drains them.

    `target` serves the socket until its own SIGTERM and returns an exit code (STARTUP_FAILURE when its app
    could not start). `drain` is how long a worker may take to finish its open requests once told to stop.
    """

    def __init__(
        self,
        count: int,
        target: Callable[[socket.socket], int],
        sock: socket.socket,
        *,
        drain: float,
        on_exit: Callable[[int], None] | None = None,
        on_stop: Callable[[], None] | None = None,
    ) -> None:
        self._count = count
        # Told each dead worker's pid (its live metrics go with it; see metrics.multiprocess.forget_worker).
        self._on_exit = on_exit
        # Called from the stop signal's handler, before the workers are told: it must only record (a flag in
        # shared memory that makes every worker's /ready say 503 at once).
        self._on_stop = on_stop
        self._target = target
        self._sock = sock
        self._drain = drain
        self._workers: list[BaseProcess] = []
        self._started_at: dict[int, float] = {}
        self._pause = 0.0
        # Set by the signal handler (hence read through `_stop_requested`, which type narrowing cannot see into).
        self._stopping = False

    @property
    def pids(self) -> list[int]:
        """The running workers' process ids."""
        return [worker.pid for worker in self._workers if worker.pid is not None]

    def run(self) -> int:
        """Start the workers, replace any that dies, and on a signal drain them all; the exit code."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            for _ in range(self._count):
                self._start_one()
            logger.info("serving with %d worker processes: %s", self._count, self.pids)
            code = self._supervise()
            self._stop_all()
            return code
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._stopping = True
        if self._on_stop is not None:
            self._on_stop()

    def _stop_requested(self) -> bool:
        return self._stopping

    def _start_one(self) -> None:
        worker = _fork.Process(target=_run_worker, args=(self._target, self._sock, os.getpid()), name="gateway-worker")
        worker.start()
        self._workers.append(worker)
        assert worker.pid is not None
        self._started_at[worker.pid] = time.monotonic()

    def _supervise(self) -> int:
        while not self._stop_requested():
            # The sentinels become readable when a worker exits; the timeout lets a recorded signal act.
            dead = wait([worker.sentinel for worker in self._workers], timeout=0.5)
            for worker in [w for w in self._workers if w.sentinel in dead]:
                worker.join()
                self._workers.remove(worker)
                assert worker.pid is not None
                if self._on_exit is not None:
                    self._on_exit(worker.pid)
                lived = time.monotonic() - self._started_at.pop(worker.pid, 0.0)
                if worker.exitcode == STARTUP_FAILURE:
                    logger.error("worker %d could not start its app; stopping the gateway", worker.pid)
                    return STARTUP_FAILURE
                if self._stop_requested():
                    break
                self._pause = min(max(self._pause * 2, 0.5), _MAX_PAUSE) if lived < _SHORT_LIFE else 0.0
                logger.warning(
                    "worker %d exited (code %s) after %.1f s; starting a replacement%s",
                    worker.pid,
                    worker.exitcode,
                    lived,
                    f" in {self._pause:g} s" if self._pause else "",
                )
                self._sleep(self._pause)
                if not self._stop_requested():
                    self._start_one()
        return 0

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self._stop_requested() and time.monotonic() < deadline:
            time.sleep(min(0.1, deadline - time.monotonic()))

    def _stop_all(self) -> None:
        """Stop accepting, tell every worker to drain, and kill those still running after the drain bound."""
        # Closed here first, so once every worker has closed its copy new connections are refused at once
        # rather than queued on a socket nobody accepts from.
        self._sock.close()
        logger.info("stopping %d worker processes (drain up to %g s)", len(self._workers), self._drain)
        for worker in self._workers:
            if worker.pid is not None and worker.exitcode is None:
                os.kill(worker.pid, signal.SIGTERM)
        deadline = time.monotonic() + self._drain + _KILL_MARGIN
        for worker in self._workers:
            worker.join(max(0.0, deadline - time.monotonic()))
            if worker.exitcode is None:
                logger.warning("worker %d did not stop within its drain bound; killing it", worker.pid)
                worker.kill()
                worker.join()
        self._workers.clear()
