"""EngineActivity: what the relay sees of the engine working, for the monitor to judge liveness by.

The relay records progress (a streamed chunk, a finished answer) as one monotonic timestamp, so a
saturated engine whose /health answers late is still seen to work; it registers every exchange in
flight, so the monitor can tell "idle" from "stalled" and end the exchanges of a stuck engine.
Imports nothing of the gateway.
"""

from __future__ import annotations

import time
from typing import Protocol


class Abortable(Protocol):
    """An exchange in flight that can be ended when the engine is found stuck."""

    def abort_frozen(self) -> None:
        """End the exchange now with an error saying the engine stopped generating."""
        ...


class EngineActivity:
    """The last time the engine made progress, and the exchanges waiting on it now."""

    __slots__ = ("_in_flight", "last_progress")

    def __init__(self) -> None:
        self.last_progress = time.monotonic()
        self._in_flight: set[Abortable] = set()

    def progress(self) -> None:
        """The engine produced something (a chunk, an answer): it generates."""
        self.last_progress = time.monotonic()

    def quiet_for(self) -> float:
        """Seconds since the engine last made progress."""
        return time.monotonic() - self.last_progress

    @property
    def in_flight(self) -> int:
        """Exchanges waiting on the engine now."""
        return len(self._in_flight)

    def begin(self, exchange: Abortable) -> None:
        """`exchange` now waits on the engine."""
        self._in_flight.add(exchange)

    def end(self, exchange: Abortable) -> None:
        """`exchange` no longer waits on the engine (safe to call twice)."""
        self._in_flight.discard(exchange)

    def abort_all(self) -> int:
        """End every exchange in flight (the engine is stuck); how many there were."""
        exchanges, self._in_flight = self._in_flight, set()
        for exchange in exchanges:
            exchange.abort_frozen()
        return len(exchanges)
