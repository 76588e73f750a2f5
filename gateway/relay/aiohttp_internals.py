"""Every use the gateway makes of aiohttp's internals: the engine response's StreamReader, given a subclass.

Tested with aiohttp 3.14.5; `pyproject.toml` bounds aiohttp below 3.15, the next minor release that could change
any of this. `INTERNALS` declares each name relied upon, and tests/unit/test_library_internals.py checks them
against the installed aiohttp, so an upgrade that drops one fails a test, not a request. What is relied upon:

- `aiohttp.StreamReader` (a response's `content`) is a plain Python class with `__slots__`, so a live reader can
  take a subclass that adds no slots by `__class__` assignment (`adopt_reader`, `tap_reader`); the subclasses
  below add none.
- `EngineStreamReader` overrides `readany()` and reads `_exception` (the connection's stored error) and
  `_buffer` (what arrived and was not read yet), and calls `_read_nowait(-1)` (take everything buffered).
- `TappedStreamReader` overrides `feed_data(data, size)`, which the connection's data callback calls with each
  chunk of the body; returning False without buffering is what it does for an empty chunk.

Imports the gateway's declaration type (`LibraryInternals`) only.
"""

from __future__ import annotations

from collections.abc import Callable

import aiohttp

from gateway.types import LibraryInternals

# A tap sees each body chunk in the connection's data callback and returns True when it relayed it itself.
Tap = Callable[[bytes], bool]
# Taps by id() of the reader: aiohttp's StreamReader has __slots__, so the tap cannot be an attribute of it.
_taps: dict[int, Tap] = {}


class EngineStreamReader(aiohttp.StreamReader):
    """aiohttp's StreamReader that hands over what it buffered before raising the connection's error.

    aiohttp's `readany()` raises a stored error before it returns buffered bytes, so a stream the engine cut right
    after a burst lost the chunks that had arrived (at 0 ms between tokens, 2 of 40 streams got only the error).
    Same slots as its base, so a live reader can become one (`__class__` assignment).
    """

    __slots__ = ()

    async def readany(self) -> bytes:
        """What is buffered, even when the connection has failed since; else aiohttp's `readany()`."""
        if self._exception is not None and self._buffer:
            return self._read_nowait(-1)
        return await super().readany()


class TappedStreamReader(EngineStreamReader):
    """The engine's StreamReader that offers each chunk to its tap before buffering it (the fast relay path).

    A chunk the tap relays never enters the buffer: no future is resolved and the reading task is not woken for it.
    """

    __slots__ = ()

    def feed_data(self, data: bytes, size: int = 0) -> bool:
        """Offer `data` to the tap; buffer it (aiohttp's `feed_data`) unless the tap relayed it."""
        tap = _taps.get(id(self))
        if tap is not None and data and tap(data):
            return False
        return super().feed_data(data, size)


def adopt_reader(content: aiohttp.StreamReader) -> None:
    """Make a response's own reader an `EngineStreamReader` (a reader of another type is left as it is)."""
    if type(content) is aiohttp.StreamReader:
        content.__class__ = EngineStreamReader


def tap_reader(content: aiohttp.StreamReader, relay: Tap) -> bool:
    """Offer every further chunk of `content` to `relay` in the connection's data callback; False (nothing done)
    when `content` was not adopted."""
    if type(content) is not EngineStreamReader:
        return False
    content.__class__ = TappedStreamReader
    _taps[id(content)] = relay
    return True


def untap_reader(content: aiohttp.StreamReader) -> None:
    """Forget `content`'s tap (the response is closed or released; its id may be reused)."""
    _taps.pop(id(content), None)


INTERNALS: tuple[LibraryInternals, ...] = (
    LibraryInternals(
        aiohttp.StreamReader,
        subclass=EngineStreamReader,
        overridden=("readany",),
        used=("__slots__", "_exception", "_buffer", "_read_nowait"),
    ),
    LibraryInternals(aiohttp.StreamReader, subclass=TappedStreamReader, overridden=("feed_data",)),
)
