"""A stopping gateway drains: the stop signal marks the app draining and /ready answers 503 from then on, so a
load balancer stops sending to it before it goes.

The route is called with a real app's state and stand-in services (an engine known ready, Redis answering),
so the only thing that can make it answer 503 is the drain.
"""

from __future__ import annotations

import asyncio
import gc
import signal
import socket
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
import uvicorn
from fastapi import FastAPI
from starlette.requests import Request

from gateway.api.health import ready
from gateway.app import create_app
from gateway.http.client_limits import ClientLimits
from gateway.http.uvicorn_internals import _DRAIN_IDLE, DrainingServer, GuardedHttpToolsProtocol, ServerConfig
from gateway.settings import Settings
from tests.clock import virtual_time

pytestmark = pytest.mark.timeout(30)

_OK = {"engine": {"ok": True, "reason": None}, "redis": {"ok": True, "reason": None}, "models": [], "replicas": []}


@dataclass
class _ReadyPool:
    """A pool every model of which has a ready replica."""

    async def confirm(self) -> None:
        pass

    def not_ready_reason(self) -> str | None:
        return None

    def views(self) -> list[Any]:
        return []


@dataclass
class _HealthyServices:
    settings: Settings = field(default_factory=Settings)
    pool: _ReadyPool = field(default_factory=_ReadyPool)

    async def check_redis(self) -> str | None:
        return None


async def _ready(app: FastAPI) -> tuple[int, dict[str, Any]]:
    app.state.services = _HealthyServices()
    response = await ready(Request({"type": "http", "method": "GET", "path": "/ready", "headers": [], "app": app}))
    return response.status_code, orjson.loads(bytes(response.body))


async def test_a_stop_signal_turns_ready_into_503_draining() -> None:
    settings = Settings()
    app = create_app(settings)
    server = DrainingServer(ServerConfig(app, limits=ClientLimits.from_settings(settings)))
    assert await _ready(app) == (200, {"status": "ready", "draining": False, **_OK})

    server.handle_exit(signal.SIGTERM, None)

    assert server.should_exit
    status, body = await _ready(app)
    assert (status, body) == (503, {"status": "draining", "draining": True, **_OK})


@virtual_time
async def test_the_idle_server_loop_ticks_once_a_second_and_a_stop_signal_ends_it_at_once() -> None:
    settings = Settings()
    server = DrainingServer(ServerConfig(create_app(settings), limits=ClientLimits.from_settings(settings)))
    ticks = 0
    tick = server.on_tick

    async def counted(counter: int) -> bool:
        nonlocal ticks
        ticks += 1
        return await tick(counter)

    server.on_tick = counted  # type: ignore[method-assign]  # counting what the loop does while idle
    server.config.load()  # what uvicorn's startup does first: on_tick reads the encoded headers
    server.server_state = uvicorn.server.ServerState()
    loop = asyncio.get_running_loop()
    loop_task = asyncio.create_task(server.main_loop())
    await asyncio.sleep(1.5)  # on the loop's virtual clock: exactly 1.5 s of loop time, however busy the machine
    # uvicorn's own loop ticks ten times a second (16 here); this one once a second, for the Date header: at 0 and 1.
    assert ticks == 2, ticks
    assert server.server_state.default_headers[0][0] == b"date"
    stopped_at = loop.time()
    server.handle_exit(signal.SIGTERM, None)
    await asyncio.wait_for(loop_task, 5)
    # At once, not at the next tick (half a second of loop time away): the signal wakes the loop.
    assert loop.time() == stopped_at


@pytest.mark.parametrize("serving", [True, False], ids=["serving", "test"])
async def test_a_started_serving_process_takes_what_it_holds_out_of_the_collectors_scans(serving: bool) -> None:
    settings = Settings()
    config = ServerConfig(create_app(settings), limits=ClientLimits.from_settings(settings), freeze_heap=serving)
    config.load()
    server = DrainingServer(config)
    server.server_state = uvicorn.server.ServerState()
    assert gc.get_freeze_count() == 0
    loop_task = asyncio.create_task(server.main_loop())
    try:
        await asyncio.sleep(0.2)
        # Serving, every object alive at start (the app among them) is frozen; a test's server freezes nothing, so
        # its leaks stay visible to the collector.
        assert (gc.get_freeze_count() > 10_000) is serving, gc.get_freeze_count()
        server.handle_exit(signal.SIGTERM, None)
        await asyncio.wait_for(loop_task, 5)
    finally:
        gc.unfreeze()


async def _accepted_after_the_stop_signal() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection the server's protocol receives once the stop signal has come (uvicorn may accept one in the
    loop pass that stops listening, after it has told the open connections to drain); the client's end."""
    settings = Settings()
    config = ServerConfig(
        create_app(settings), limits=ClientLimits.from_settings(settings), http=GuardedHttpToolsProtocol
    )
    config.load()
    server = DrainingServer(config)
    server.server_state = uvicorn.server.ServerState()
    server.handle_exit(signal.SIGTERM, None)
    ours, theirs = socket.socketpair()
    await asyncio.get_running_loop().connect_accepted_socket(
        lambda: GuardedHttpToolsProtocol(config, server.server_state, {}), theirs
    )
    return await asyncio.open_connection(sock=ours)


@pytest.mark.parametrize("silent", [False, True])
@virtual_time
async def test_a_connection_made_after_the_stop_signal_is_answered_once_and_closed(silent: bool) -> None:
    # Kept alive, it would carry requests until the grace ran out and the process ended under one of them.
    reader, writer = await _accepted_after_the_stop_signal()
    try:
        if not silent:
            writer.write(b"GET /health HTTP/1.1\r\nhost: gateway\r\n\r\n")
        loop = asyncio.get_running_loop()
        started = loop.time()
        answer = await asyncio.wait_for(reader.read(), 5)  # to EOF: the server closes the connection
        if silent:
            assert answer == b""
            # On the loop's virtual clock: after the linger for a request on its way, at once when it ends.
            assert loop.time() - started == pytest.approx(_DRAIN_IDLE)
        else:
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200")
            assert b"connection: close" in head.lower()
            assert body == b'{"status":"ok"}'
    finally:
        writer.close()
