"""EngineActivity: what the relay sees of the engine working, for the monitor to judge liveness by.

The relay records progress (a streamed chunk, a finished answer) as one monotonic timestamp, so a
saturated engine whose /health answers late is still seen to work; it registers every exchange in
flight, so the monitor can tell "idle" from "stalled" and end the exchanges of a stuck engine.
Both are gateway-wide: the timestamp lives in the gateway's SharedEngineState and this worker's count of
exchanges in its own slot there, so the one worker that probes judges by every worker's traffic.
Imports the relay's shared state only.
"""

from __future__ import annotations

import time
from typing import Protocol

from gateway.relay.readiness import SharedEngineState


class Abortable(Protocol):
    """An exchange in flight that can be ended when the engine is found stuck."""

    def abort_frozen(self) -> None:
        """End the exchange now with an error saying the engine stopped generating."""
        ...


class EngineActivity:
    """The last time the engine made progress (any worker), and the exchanges this worker has waiting on it."""

    __slots__ = ("_in_flight", "_slot", "shared")

    def __init__(self, shared: SharedEngineState | None = None) -> None:
        # A private record when none is given: one process, nothing shared (tests, a single worker).
        self.shared = shared or SharedEngineState()
        self._slot = self.shared.claim_slot()
        self._in_flight: set[Abortable] = set()

    @property
    def last_progress(self) -> float:
        """When the engine last produced something for any worker of the gateway (time.monotonic())."""
        return self.shared.last_progress

    @last_progress.setter
    def last_progress(self, value: float) -> None:
        self.shared.last_progress = value

    def progress(self) -> None:
        """The engine produced something (a chunk, an answer): it generates."""
        self.shared.stamp_progress()

    def quiet_for(self) -> float:
        """Seconds since the engine last made progress (for any worker)."""
        return time.monotonic() - self.shared.last_progress

    @property
    def in_flight(self) -> int:
        """Exchanges waiting on the engine now, in this worker."""
        return len(self._in_flight)

    def begin(self, exchange: Abortable) -> None:
        """`exchange` now waits on the engine."""
        self._in_flight.add(exchange)
        self._publish()

    def end(self, exchange: Abortable) -> None:
        """`exchange` no longer waits on the engine (safe to call twice)."""
        self._in_flight.discard(exchange)
        self._publish()

    def abort_all(self) -> int:
        """End every exchange in flight in this worker (the engine is stuck); how many there were."""
        exchanges, self._in_flight = self._in_flight, set()
        self._publish()
        for exchange in exchanges:
            exchange.abort_frozen()
        return len(exchanges)

    def _publish(self) -> None:
        if self._slot is not None:
            self.shared.set_in_flight(self._slot, len(self._in_flight))
