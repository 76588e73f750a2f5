"""Two minimal pure-ASGI pass-through relays to an engine, one on httpx and one on aiohttp, for comparing clients.

Each holds ONE shared client for its lifetime, forwards the POST body as it is, and relays the answer:
buffered when it is JSON, chunk by chunk when it is an event stream. Nothing else (no validation, no
metrics), so the CPU they cost is the HTTP client's plus uvicorn's. Imports nothing from `gateway`.

    python -m loadtest.passthrough --client httpx|aiohttp --port P --engine-url URL
"""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

import aiohttp
import httpx
import uvicorn

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Message, Receive, Send], Awaitable[None]]
_JSON = {"content-type": "application/json"}


async def _read_body(receive: Receive) -> bytes:
    parts = []
    while True:
        message = await receive()
        parts.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(parts)


async def _lifespan(receive: Receive, send: Send, startup: Callable[[], Any], shutdown: Callable[[], Any]) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            startup()
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await shutdown()
            await send({"type": "lifespan.shutdown.complete"})
            return


async def _answer_ok(send: Send) -> None:
    """Any GET (the benchmark's readiness poll) is answered here, without the engine."""
    await send(_start(200, "text/plain"))
    await send({"type": "http.response.body", "body": b"ok"})


def _start(status: int, content_type: str) -> Message:
    return {"type": "http.response.start", "status": status, "headers": [(b"content-type", content_type.encode())]}


def httpx_relay(engine_url: str) -> ASGIApp:
    """The relay on one shared httpx.AsyncClient."""
    holder: dict[str, httpx.AsyncClient] = {}

    def startup() -> None:
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
        holder["client"] = httpx.AsyncClient(base_url=engine_url, timeout=httpx.Timeout(30.0), limits=limits)

    async def app(scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send, startup, lambda: holder["client"].aclose())
            return
        if scope["method"] == "GET":
            await _answer_ok(send)
            return
        client = holder["client"]
        request = client.build_request("POST", scope["path"], content=await _read_body(receive), headers=_JSON)
        upstream = await client.send(request, stream=True)
        try:
            content_type = upstream.headers.get("content-type", "application/json")
            await send(_start(upstream.status_code, content_type))
            if content_type.startswith("text/event-stream"):
                async for chunk in upstream.aiter_raw():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b""})
            else:
                await send({"type": "http.response.body", "body": await upstream.aread()})
        finally:
            await upstream.aclose()

    return app


def aiohttp_relay(engine_url: str) -> ASGIApp:
    """The relay on one shared aiohttp.ClientSession."""
    holder: dict[str, aiohttp.ClientSession] = {}

    def startup() -> None:
        connector = aiohttp.TCPConnector(limit=1024)
        holder["client"] = aiohttp.ClientSession(
            engine_url, connector=connector, timeout=aiohttp.ClientTimeout(total=30.0), auto_decompress=False
        )

    async def app(scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send, startup, lambda: holder["client"].close())
            return
        if scope["method"] == "GET":
            await _answer_ok(send)
            return
        body = await _read_body(receive)
        async with holder["client"].post(scope["path"], data=body, headers=_JSON) as upstream:
            content_type = upstream.headers.get("content-type", "application/json")
            await send(_start(upstream.status, content_type))
            if content_type.startswith("text/event-stream"):
                async for chunk in upstream.content.iter_any():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b""})
            else:
                await send({"type": "http.response.body", "body": await upstream.read()})

    return app


RELAYS: dict[str, Callable[[str], ASGIApp]] = {"httpx": httpx_relay, "aiohttp": aiohttp_relay}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: serve one relay under uvicorn (uvloop, httptools), as the gateway is served."""
    parser = argparse.ArgumentParser(prog="python -m loadtest.passthrough", description=__doc__.splitlines()[0])
    parser.add_argument("--client", choices=sorted(RELAYS), required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--engine-url", required=True)
    args = parser.parse_args(argv)
    app = RELAYS[args.client](args.engine_url.rstrip("/"))
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=args.port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        access_log=False,
        log_level="warning",
        server_header=False,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
