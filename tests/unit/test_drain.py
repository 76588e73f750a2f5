"""A stopping gateway drains: the stop signal marks the app draining and /ready answers 503 from then on (issue 10).

The route is called with a real app's state and stand-in services (an engine known ready, Redis answering),
so the only thing that can make it answer 503 is the drain.
"""

from __future__ import annotations

import asyncio
import signal
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from fastapi import FastAPI
from starlette.requests import Request

from gateway.app import create_app
from gateway.routes.health import ready
from gateway.server import ClientLimits, DrainingServer, ServerConfig
from gateway.settings import Settings

pytestmark = pytest.mark.timeout(30)

_OK = {"engine": {"ok": True, "reason": None}, "redis": {"ok": True, "reason": None}}


@dataclass
class _ReadyMonitor:
    model: Any = None

    async def confirmed_reason(self) -> str | None:
        return None


@dataclass
class _HealthyServices:
    settings: Settings = field(default_factory=Settings)
    monitor: _ReadyMonitor = field(default_factory=_ReadyMonitor)

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


async def test_the_idle_main_loop_wakes_once_a_second_and_at_once_on_a_stop_signal() -> None:
    # uvicorn's own loop wakes ten times a second to look for a stop signal: 16 idle workers spent most of
    # their CPU on it.
    settings = Settings()
    server = DrainingServer(ServerConfig(create_app(settings), limits=ClientLimits.from_settings(settings)))
    server.config.load()
    ticks = 0
    on_tick = server.on_tick

    async def counted(counter: int) -> bool:
        nonlocal ticks
        ticks += 1
        return await on_tick(counter)

    server.on_tick = counted  # type: ignore[method-assign]
    loop = asyncio.get_running_loop()
    running = asyncio.ensure_future(server.main_loop())
    await asyncio.sleep(2.5)
    signalled = loop.time()
    server.handle_exit(signal.SIGTERM, None)
    await asyncio.wait_for(running, 5)
    assert ticks <= 5, f"{ticks} wake-ups in 2.5 s"
    assert loop.time() - signalled < 0.5, "the stop signal waited for the next tick"
    assert server.server_state.default_headers, "the Date header is refreshed on every tick"
