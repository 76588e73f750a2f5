"""The gateway's server tells a request that its client left, without anyone reading `receive`.

uvicorn with the gateway's protocol (`GuardedHttpToolsProtocol`) on a loopback port, serving a minimal ASGI app
that waits on "the engine" through `run_until_disconnect` with the watch the server put in its scope; a raw client
sends a request and hangs up.
"""

from __future__ import annotations

import asyncio

import pytest

from gateway.relay.disconnect import ClientDisconnectedError, disconnect_watch, run_until_disconnect
from gateway.types import Message, Receive, Scope, Send
from tests.procs import serving_on_loopback

pytestmark = pytest.mark.timeout(20)

REQUEST = b"POST /work HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


class WaitingApp:
    """Reads the body, then waits on work that never ends unless cancelled; records how it ended."""

    def __init__(self) -> None:
        self.watched: list[bool] = []
        self.outcome: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.reads_after_body = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await receive()  # the body

        async def counted() -> Message:
            self.reads_after_body += 1
            return await receive()

        async def engine() -> None:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                self.outcome.set_result("work cancelled")
                raise

        watch = disconnect_watch(scope)
        self.watched.append(watch is not None)
        try:
            await run_until_disconnect(counted, engine(), watch)
        except ClientDisconnectedError:
            await asyncio.sleep(0)  # the request's task is not left cancelled: it goes on to answer 499
            await send({"type": "http.response.start", "status": 499, "headers": []})
            await send({"type": "http.response.body", "body": b""})


async def test_a_client_hanging_up_cancels_the_work_through_the_servers_watch() -> None:
    app = WaitingApp()
    async with serving_on_loopback(app) as port:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(REQUEST)
        await writer.drain()
        await asyncio.sleep(0.2)  # the app waits on its work now
        assert not app.outcome.done()
        writer.close()
        assert await asyncio.wait_for(app.outcome, 5) == "work cancelled"
        assert app.watched == [True]
        assert app.reads_after_body == 0  # nobody read `receive` to learn it
