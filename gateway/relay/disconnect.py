"""The client-disconnect watcher: runs one exchange with the engine until it ends or its client goes away.

A request's work (the engine exchange of a non-streamed request, the pump of a stream) awaits the engine, not the
client, so nothing else would notice a client that hung up; `run_until_disconnect` cancels the work at the
disconnect, which closes its engine connection, so vLLM aborts the generation and frees its KV cache. Under the
gateway's own server the connection says so itself (a `DisconnectWatch` in the scope, called from the protocol's
`connection_lost`): the work runs in the request's own task, with no second task and no reader of `receive`
beside it. Without one (another ASGI server), a task reads `receive` alongside the work. Speaks raw ASGI; imports
only the gateway's ASGI types.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any, Final, Protocol, TypeVar

from gateway.types import Receive, Scope

T = TypeVar("T")

# The scope key under which the gateway's server offers the request's `DisconnectWatch`.
DISCONNECT_WATCH: Final = "nemotron.disconnect_watch"


class ClientDisconnectedError(Exception):
    """The client went away before the answer was complete (logged with status 499)."""


class DisconnectWatch(Protocol):
    """One request's connection, telling when its client disconnects (the gateway's server offers one)."""

    def arm(self, callback: Callable[[], None]) -> bool:
        """Call `callback` (once) when the client disconnects; False, and nothing armed, if it already has."""
        ...

    def disarm(self) -> None:
        """No callback any more."""
        ...


def disconnect_watch(scope: Scope) -> DisconnectWatch | None:
    """The request's `DisconnectWatch`, if its server offers one."""
    watch: DisconnectWatch | None = scope.get(DISCONNECT_WATCH)
    return watch


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def run_until_disconnect(
    receive: Receive, work: Coroutine[Any, Any, T], watch: DisconnectWatch | None = None
) -> T:
    """Await `work` unless the client disconnects first; then cancel it and raise ClientDisconnectedError.

    Cancelling `work` closes its engine connection, so vLLM aborts the generation and frees its KV
    cache: a non-streamed request must not run on for minutes after its client has gone. With `watch`, the work
    runs in the caller's task, which the watch's callback cancels; else a task reads `receive` beside it.
    """
    if watch is None:
        return await _run_reading_receive(receive, work)
    task = asyncio.current_task()
    assert task is not None
    gone = False

    def on_disconnect() -> None:
        nonlocal gone
        gone = True
        task.cancel()

    if not watch.arm(on_disconnect):
        work.close()  # never started: nothing was sent to the engine
        raise ClientDisconnectedError
    try:
        result = await work
    except asyncio.CancelledError:
        if gone and task.uncancel() == 0:
            raise ClientDisconnectedError from None
        raise
    finally:
        watch.disarm()
    if gone:
        task.uncancel()  # the work ended its own way despite the cancel; the client is gone all the same
    return result


async def _run_reading_receive(receive: Receive, work: Coroutine[Any, Any, T]) -> T:
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        watcher.cancel()
        raise
    watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise ClientDisconnectedError
