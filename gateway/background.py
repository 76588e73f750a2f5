"""BackgroundTask: the one way a service runs a long-lived asyncio task (listener, renewer, monitor).

Start it, run its body again after a failure (exponential backoff with jitter), stop it with a bounded wait.
Imports nothing of ours, so every service may use it.

Why the wait is bounded: redis-py can turn the cancellation of a blocked read into a ConnectionError, which
a reconnect loop would survive; `stop()` therefore sets a flag the loop honours before it cancels, and gives
up waiting after `stop_timeout` (logged) instead of hanging the shutdown (uvicorn bounds every wait likewise).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Backoff:
    """Delays between runs of a failing body: `initial` doubling up to `maximum`, with equal jitter."""

    initial: float = 0.1
    maximum: float = 5.0
    multiplier: float = 2.0

    def delay(self, failures: int) -> float:
        """Seconds to wait after the `failures`-th failure in a row (1-based).

        Half the delay is fixed and half random: processes that lost Redis together do not retry together,
        and no retry comes sooner than half its step.
        """
        ceiling = min(self.maximum, self.initial * self.multiplier ** max(0, failures - 1))
        return ceiling / 2 + random.uniform(0, ceiling / 2)  # jitter, not a secret


class BackgroundTask:
    """Runs `body` in a task until it returns or `stop()` is called; a body that raises runs again.

    - `expected`: exception types of a known outage (Redis down): logged as one warning per run of failures,
      without a traceback. Any other exception is logged with its traceback, and retried the same way.
    - A body that ran at least `backoff.maximum` seconds before failing starts over from the initial delay.
    - `stop()` cancels, waits at most `stop_timeout` seconds, and never restarts the body afterwards.
    """

    def __init__(
        self,
        name: str,
        body: Callable[[], Awaitable[object]],
        *,
        expected: tuple[type[BaseException], ...] = (),
        backoff: Backoff | None = None,
        stop_timeout: float = 5.0,
    ) -> None:
        self.name = name
        self._body = body
        self._expected = expected
        self._backoff = backoff or Backoff()
        self._stop_timeout = stop_timeout
        self._task: asyncio.Task[None] | None = None  # a reference, so the task is not garbage-collected
        self._stopping = False
        self.failures = 0  # failures in a row; 0 while the body runs well

    @classmethod
    def every(
        cls,
        name: str,
        interval: float,
        tick: Callable[[], Awaitable[object]],
        *,
        expected: tuple[type[BaseException], ...] = (),
        backoff: Backoff | None = None,
        stop_timeout: float = 5.0,
    ) -> BackgroundTask:
        """A task that awaits `tick()` every `interval` seconds (the first one after `interval`)."""

        async def periodic() -> None:
            while True:
                await asyncio.sleep(interval)
                await tick()

        return cls(name, periodic, expected=expected, backoff=backoff, stop_timeout=stop_timeout)

    @property
    def running(self) -> bool:
        """Whether the task was started, not stopped, and has not finished."""
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        """Start the task (in the running loop); a second call while it runs does nothing."""
        if self.running:
            return
        self._stopping = False
        self.failures = 0
        self._task = asyncio.create_task(self._run(), name=self.name)

    async def stop(self) -> bool:
        """Cancel the task and wait for it, at most `stop_timeout` s; False (and a warning) if it did not end."""
        task, self._task = self._task, None
        if task is None:
            return True
        self._stopping = True
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=self._stop_timeout)
        if not done:
            logger.warning("background task %s did not stop within %.1f s; left behind", self.name, self._stop_timeout)
            return False
        if not task.cancelled() and task.exception() is not None:
            logger.warning("background task %s ended with %r", self.name, task.exception())
        return True

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopping:
            started = loop.time()
            try:
                await self._body()
                return
            except Exception as exc:
                if self._stop_requested():
                    return  # our own cancellation, turned into another error by a library
                if loop.time() - started >= self._backoff.maximum:
                    self.failures = 0
                self.failures += 1
                delay = self._backoff.delay(self.failures)
                self._log_failure(exc, delay)
            await asyncio.sleep(delay)

    def _stop_requested(self) -> bool:
        return self._stopping

    def _log_failure(self, exc: Exception, delay: float) -> None:
        if not isinstance(exc, self._expected):
            logger.error("background task %s failed; again in %.2f s", self.name, delay, exc_info=exc)
        elif self.failures == 1:
            logger.warning("background task %s failed (%s); retrying with backoff", self.name, type(exc).__name__)
        else:
            logger.debug("background task %s failed again (%s); again in %.2f s", self.name, exc, delay)
