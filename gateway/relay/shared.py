"""SharedInstant: one monotonic timestamp that every forked worker of a gateway reads and writes.

Each worker's EngineMonitor probes the engine on its own. `engine_seen_ready()` tells a worker that
another one has seen the engine come back since it last saw it down, so it asks the engine again at
once instead of refusing until its own next probe. It is an 8-byte anonymous shared mapping, made once
per process tree: the server makes it before it forks its workers (gateway/server.py), so they all
share the one mapping; time.monotonic() is one clock for every process on the machine. Stdlib only.
"""

from __future__ import annotations

import functools
import mmap
import struct
import time

_FORMAT = "d"


class SharedInstant:
    """A time.monotonic() value shared by this process and the processes it forks (0.0 until recorded)."""

    def __init__(self) -> None:
        # Anonymous and MAP_SHARED (mmap's default on Unix): a fork shares the page instead of copying it.
        self._memory = mmap.mmap(-1, struct.calcsize(_FORMAT))

    def record_now(self) -> None:
        """Set the shared value to now."""
        struct.pack_into(_FORMAT, self._memory, 0, time.monotonic())

    def value(self) -> float:
        """The last value recorded by any process sharing it."""
        recorded: float = struct.unpack_from(_FORMAT, self._memory, 0)[0]
        return recorded


@functools.cache
def engine_seen_ready() -> SharedInstant:
    """When any worker of this gateway last found the engine ready (made on first use; forks inherit it)."""
    return SharedInstant()
