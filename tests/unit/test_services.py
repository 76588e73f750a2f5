"""A gateway whose start fails part-way leaves nothing open: the parts already started are stopped.

Real parts against a real Redis and an engine answering in this process; one later part (the rate limiter) fails
to start, and afterwards no task of the gateway is left running and no connection of this process to the engine
or to Redis is left open.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from aiohttp import web

from gateway.metrics.instruments import GatewayMetrics
from gateway.relay.readiness import SharedPoolState
from gateway.services import Services
from gateway.settings import Settings
from tests.procs import free_port

pytestmark = pytest.mark.timeout(30)

_ESTABLISHED = "01"


def _open_connections_to(port: int) -> int:
    """This process's established TCP connections whose remote end is 127.0.0.1:`port` (from /proc/net/tcp)."""
    ours = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            ours.add(target[len("socket:[") : -1])
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        remote, state, inode = fields[2], fields[3], fields[9]
        if inode in ours and state == _ESTABLISHED and int(remote.split(":")[1], 16) == port:
            count += 1
    return count


@pytest.fixture
async def engine_port() -> AsyncIterator[int]:
    async def health(request: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "nemotron", "max_model_len": 4096}]})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield port
    await runner.cleanup()


def _gateway_tasks() -> list[asyncio.Task[object]]:
    current = asyncio.current_task()
    return [task for task in asyncio.all_tasks() if task is not current and not task.done()]


async def test_a_part_failing_to_start_leaves_no_task_or_connection_open(
    engine_port: int, redis_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    redis_port = urlsplit(redis_url).port or 6379
    settings = Settings(
        engine_url=f"http://127.0.0.1:{engine_port}",
        redis_url=redis_url,
        auth={"enabled": True},
        relay={"probe_interval": 0.05, "probe_timeout": 0.5},
        engine={"state_dir": tmp_path},
    )
    services = Services.build(settings, GatewayMetrics(), SharedPoolState())
    started: list[str] = []

    async def limiter_fails() -> None:
        # By now the engine client, the monitor and the key store's subscription are up.
        started.append(f"engine {_open_connections_to(engine_port)}, redis {_open_connections_to(redis_port)}")
        raise RuntimeError("the limiter cannot start")

    monkeypatch.setattr(services.limiter, "start", limiter_fails)
    tasks_before = set(_gateway_tasks())
    with pytest.raises(RuntimeError, match="the limiter cannot start"):
        await services.start()
    assert started and started[0] != "engine 0, redis 0", f"nothing was open before the failure: {started}"
    await asyncio.sleep(0.1)  # a cancelled task finishes on the next turns of the loop
    assert set(_gateway_tasks()) <= tasks_before, f"left running: {set(_gateway_tasks()) - tasks_before}"
    assert _open_connections_to(engine_port) == 0, "a connection to the engine was left open"
    assert _open_connections_to(redis_port) == 0, "a connection to Redis was left open"
