"""A served request's objects go when it ends: nothing the gateway's server adds to a request (the body writer, the
disconnect watch) makes a reference cycle, so the request's scope, record and cycle are freed by reference counting
at once, not left for the garbage collector to find (which, at c=32, walked every request's objects again).

uvicorn with the gateway's protocol on a loopback port, a minimal ASGI app that streams through the server's body
writer and arms its disconnect watch, as the relay does; a raw client sends requests on one keep-alive connection.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator

import pytest
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from gateway.relay.disconnect import disconnect_watch
from gateway.relay.sse import BODY_WRITER
from gateway.request_record import RequestRecord
from gateway.types import Receive, Scope, Send
from tests.procs import serving_on_loopback

pytestmark = pytest.mark.timeout(20)

REQUEST = b"POST /stream HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


async def streaming_app(scope: Scope, receive: Receive, send: Send) -> None:
    """Keeps a record in the scope (as the middleware does), arms the watch and writes one chunk straight to the
    connection (as the relay does), then ends the stream through ASGI."""
    scope.setdefault("state", {})["record"] = RequestRecord(request_id="r", started_at=0.0)
    await receive()
    watch = disconnect_watch(scope)
    assert watch is not None and watch.arm(lambda: None)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    writer = scope[BODY_WRITER]  # type: ignore[literal-required]  # the server's own scope key
    assert writer.write(b"data: 1\n\n")
    watch.disarm()
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


@pytest.fixture
def collector_saving_garbage() -> Iterator[None]:
    """The collector keeps what it finds unreachable in `gc.garbage` instead of freeing it."""
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        yield
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


@pytest.mark.usefixtures("collector_saving_garbage")
async def test_served_requests_leave_nothing_for_the_garbage_collector() -> None:
    async with serving_on_loopback(streaming_app) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(20):
            writer.write(REQUEST)
            await writer.drain()
            answer = await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), 5)
            assert b"data: 1\n\n" in answer and b"data: [DONE]" in answer
        writer.close()
        await writer.wait_closed()
    gc.collect()
    left = [type(found).__name__ for found in gc.garbage if isinstance(found, RequestResponseCycle | RequestRecord)]
    assert left == []
