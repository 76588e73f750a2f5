"""Deadlines for the request path: `asyncio.timeout`'s behaviour at a fraction of its cost.

A request meets four or five deadlines (its body, the Redis admission, the engine's first byte and its body).
`asyncio.timeout` puts a timer on the loop for each and takes it off again: ~8 µs a use on the overhead
benchmark's machine, ~4 % of a request's CPU. Here every deadline of one loop shares one timer, set for the
earliest: entering a block that ends later than the timer (the usual case: the request path's deadlines are
seconds to minutes long, and each is entered after the ones still open) stores two numbers and moves no timer.
When the timer fires it cancels the tasks whose deadline passed and is set again for the earliest left.

Semantics are `asyncio.timeout`'s: the task is cancelled at the deadline and the block raises TimeoutError, unless
the task was also cancelled by someone else (then the CancelledError goes on); a deadline already past cancels at
the next loop turn. Imports no other gateway module.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Final

# Each loop's shared timer, weakly keyed: a closed loop (one per test) is not kept alive by its entry. No timer holds
# its loop (the loop is passed to each call), or the entry would keep its own key alive.
_timers: Final[weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _SharedTimer]] = weakref.WeakKeyDictionary()


class _SharedTimer:
    """One loop's open deadlines and the one timer set for the earliest of them."""

    __slots__ = ("_due", "_open")

    def __init__(self) -> None:
        self._open: dict[Deadline, None] = {}  # insertion-ordered set
        self._due = float("inf")  # when the live timer fires; an earlier one set later makes it stale

    def add(self, deadline: Deadline, loop: asyncio.AbstractEventLoop) -> None:
        self._open[deadline] = None
        if deadline.when < self._due:
            self._arm(deadline.when, loop)

    def discard(self, deadline: Deadline) -> None:
        # The timer stays set: when it fires for a block already left it finds nothing due and is set again.
        self._open.pop(deadline, None)

    def _arm(self, when: float, loop: asyncio.AbstractEventLoop) -> None:
        # The timer it replaces is not cancelled (that would mean holding its handle, which holds the loop): it
        # fires at its time, sees that it is stale and does nothing. Rare: most deadlines end after the timer.
        self._due = when
        loop.call_at(when, self._fire, when, loop)

    def _fire(self, when: float, loop: asyncio.AbstractEventLoop) -> None:
        if when != self._due:
            return  # stale: an earlier deadline set a timer of its own since
        self._due = float("inf")
        now = loop.time()
        for deadline in [d for d in self._open if d.when <= now]:
            del self._open[deadline]
            deadline.expire()
        if self._open:
            self._arm(min(d.when for d in self._open), loop)


# The last loop a deadline was made on, weakly, and its timer: a process serves from one loop, and a weakref call
# costs less than the mapping's lookup (which makes a weakref of its key on every call).
_last: tuple[Callable[[], asyncio.AbstractEventLoop | None], _SharedTimer] = (lambda: None, _SharedTimer())


class Deadline:
    """`async with deadline(seconds):` the block is cancelled at the deadline and raises TimeoutError."""

    __slots__ = ("_cancelling", "_expired", "_loop", "_task", "_timer", "when")

    def __init__(self, delay: float) -> None:
        global _last
        loop = asyncio.get_running_loop()
        last_loop, timer = _last
        if last_loop() is not loop:  # another loop than the last deadline's (tests, threads): look it up
            found = _timers.get(loop)
            if found is None:
                found = _timers[loop] = _SharedTimer()
            timer = found
            _last = weakref.ref(loop), timer
        self._timer = timer
        self._loop = loop
        self.when = loop.time() + delay
        self._task: asyncio.Task[object] | None = None
        self._cancelling = 0
        self._expired = False

    async def __aenter__(self) -> Deadline:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("deadline() must be used inside a task")
        self._task = task
        self._cancelling = task.cancelling()
        self._timer.add(self, self._loop)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._timer.discard(self)
        if self._expired:
            assert self._task is not None
            # As asyncio.timeout: our own cancel becomes TimeoutError; one from elsewhere as well goes on.
            if self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
                raise TimeoutError from exc

    def expire(self) -> None:
        """The deadline passed: cancel the block's task (the shared timer calls this)."""
        if self._task is not None and not self._task.done():
            self._expired = True
            self._task.cancel()

    def expired(self) -> bool:
        """Whether the deadline passed while the block ran."""
        return self._expired


def deadline(delay: float) -> Deadline:
    """A block that may run for `delay` seconds (zero or less: it is cancelled at the next loop turn), then raises
    TimeoutError; `asyncio.timeout(delay)` in behaviour, cheaper on the request path (module docstring)."""
    return Deadline(delay)
