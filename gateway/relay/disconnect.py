"""The client-disconnect watcher: runs one exchange with the engine until it ends or its client goes away.

A request's work (the engine exchange of a non-streamed request, the pump of a stream) awaits the engine, not the
client, so nothing else would notice a client that hung up; `run_until_disconnect` reads the ASGI `receive` alongside
it and cancels the work at `http.disconnect`, which closes its engine connection, so vLLM aborts the generation and
frees its KV cache. Speaks raw ASGI; imports only the gateway's ASGI types.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any, TypeVar

from gateway.types import Receive

T = TypeVar("T")


class ClientDisconnectedError(Exception):
    """The client went away before the answer was complete (logged with status 499)."""


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def run_until_disconnect(receive: Receive, work: Coroutine[Any, Any, T]) -> T:
    """Await `work` unless the client disconnects first; then cancel it and raise ClientDisconnectedError.

    Cancelling `work` closes its engine connection, so vLLM aborts the generation and frees its KV
    cache: a non-streamed request must not run on for minutes after its client has gone.
    """
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
