"""Virtual time for tests of timers: an event loop whose clock moves only when the loop would otherwise wait.

A test that asserts "the deadline fired after 0.1 s, not later" on the real clock races the machine: on two busy
cores a loop can be held up for a second. On `VirtualClockLoop` a timer fires at exactly its time as the loop
reads it, however slow the machine is: when nothing is ready, the loop's clock jumps to the next timer instead of
sleeping. I/O still works (each wait first polls the selector without blocking), so a socketpair or a pipe written
by the loop itself is read before time moves on; a loop with no timer set waits for real I/O as usual.

    @virtual_time
    async def test_x() -> None:  # a plain (synchronous) test to pytest; the body runs on a VirtualClockLoop
        ...
"""

from __future__ import annotations

import asyncio
import functools
import selectors
from collections.abc import Callable, Coroutine
from typing import Any, ParamSpec

P = ParamSpec("P")


class _InstantSelector(selectors.DefaultSelector):
    """The platform's selector, polled without blocking: a wait with a timeout moves the loop's clock instead."""

    def __init__(self, loop: VirtualClockLoop) -> None:
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:  # no timer set: only I/O (another thread's call_soon_threadsafe) can wake the loop
            events: list[tuple[selectors.SelectorKey, int]] = super().select(None)
            return events
        events = super().select(0)
        if not events and timeout > 0:
            self._loop.advance(timeout)
        return events


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """A selector event loop whose `time()` starts at 0 and moves only when the loop would wait for its next timer."""

    def __init__(self) -> None:
        self._now = 0.0
        super().__init__(_InstantSelector(self))

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        """Move the clock on (the selector does this when nothing is ready)."""
        self._now += seconds


def virtual_time(test: Callable[P, Coroutine[Any, Any, None]]) -> Callable[P, None]:
    """Run the async test `test` on a fresh VirtualClockLoop (pytest sees a synchronous test; fixtures still apply)."""

    @functools.wraps(test)
    def run(*args: P.args, **kwargs: P.kwargs) -> None:
        with asyncio.Runner(loop_factory=VirtualClockLoop) as runner:
            runner.run(test(*args, **kwargs))

    return run
