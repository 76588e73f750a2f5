"""EngineActivity: what the relay sees of the engine working, for the monitor to judge liveness by.

The relay records progress (a streamed chunk, a finished answer) as one monotonic timestamp, so a
saturated engine whose /health answers late is still seen to work; it registers every exchange in
flight, so the monitor can tell "idle" from "stalled" and end the exchanges of a stuck engine; and it counts the
requests picked for the engine that have not opened their exchange yet (`Picked`), so that the pool's picker, which
reads both counts, sees a burst of requests arriving together as load from the moment each is picked.
All are gateway-wide: the timestamp lives in the gateway's SharedEngineState and this worker's counts in its own
slot there, so the one worker that probes judges by every worker's traffic.
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

    __slots__ = ("_in_flight", "_picked", "_slot", "shared")

    def __init__(self, shared: SharedEngineState | None = None) -> None:
        # A private record when none is given: one process, nothing shared (tests, a single worker).
        self.shared = shared or SharedEngineState()
        self._slot = self.shared.claim_slot()
        self._in_flight: set[Abortable] = set()
        self._picked = 0

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

    def begin(self, exchange: Abortable, picked: Picked | None = None) -> None:
        """`exchange` now waits on the engine; `picked`: the pick it opens, no longer counted apart."""
        self._in_flight.add(exchange)
        owner = picked.detach() if picked is not None else None
        if owner is self:
            self._picked -= 1  # published below with the exchange: one store of both counts
        elif owner is not None:
            owner._unpick()
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

    def picked(self) -> Picked:
        """A request was picked for the engine: counted until it opens its exchange or will not (`Picked.release`)."""
        self._picked += 1
        self._publish()
        return Picked(self)

    def _unpick(self) -> None:
        self._picked -= 1
        self._publish()

    def _publish(self) -> None:
        if self._slot is not None:
            self.shared.set_in_flight(self._slot, len(self._in_flight), self._picked)


class Picked:
    """A request picked for an engine that has not opened its exchange yet (it may wait for admission first)."""

    __slots__ = ("_activity",)

    def __init__(self, activity: EngineActivity) -> None:
        self._activity: EngineActivity | None = activity

    def release(self) -> None:
        """It opened its exchange (counted as in flight from then on), or never will (safe to call twice)."""
        activity = self.detach()
        if activity is not None:
            activity._unpick()

    def detach(self) -> EngineActivity | None:
        """The activity it is counted on, no longer counting it (None: released already); the caller uncounts it."""
        activity, self._activity = self._activity, None
        return activity
