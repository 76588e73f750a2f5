"""/health (the process is alive) and /ready (engine and Redis answer; else 503 saying which is down).

Both answer HEAD too (load balancers probe with it). /ready reads the monitor's cached view, which a
worker that last saw the engine down confirms with one shared /health probe first (as requests do), and
Redis is pinged at most once per `Readiness.ttl` however often it is asked.
A draining gateway (stop signal received, gateway/http/server.py sets `Readiness.draining`) is not ready.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import orjson
from fastapi import APIRouter, Request, Response

from gateway.api.context import get_services
from gateway.relay.readiness import SharedPoolState

router = APIRouter()


class Readiness:
    """Redis's ping result, kept for `ttl` seconds; concurrent callers share one ping. `draining`: a stop signal
    arrived, at this process (the server sets it) or at the gateway's pool parent (the flag it set in the shared
    engine view before it signals the workers, so every worker answers 503 at once): the process finishes what it
    has and takes nothing new."""

    def __init__(self, shared: SharedPoolState | None = None, ttl: float = 1.0) -> None:
        self.ttl = ttl
        self._shared = shared
        self._stopping = False
        self._checked_at = -float("inf")
        self._reason: str | None = None
        self._running: asyncio.Future[str | None] | None = None

    @property
    def draining(self) -> bool:
        """Whether this process or its gateway got a stop signal."""
        return self._stopping or (self._shared is not None and self._shared.draining)

    @draining.setter
    def draining(self, value: bool) -> None:
        self._stopping = value

    async def redis(self, ping: Callable[[], Awaitable[str | None]]) -> str | None:
        """None when Redis answered within the last `ttl` seconds, else why not (ping run when stale)."""
        if time.monotonic() - self._checked_at < self.ttl:
            return self._reason
        if self._running is None:
            self._running = asyncio.ensure_future(self._ping(ping))
        # shield: one caller's cancellation must not cancel the ping the others wait for.
        return await asyncio.shield(self._running)

    async def _ping(self, ping: Callable[[], Awaitable[str | None]]) -> str | None:
        try:
            self._reason = await ping()
            self._checked_at = time.monotonic()
            return self._reason
        finally:
            self._running = None


@router.api_route("/health", methods=["GET", "HEAD"])
async def health() -> Response:
    """Liveness: answers while the process serves requests at all."""
    return Response(b'{"status":"ok"}', media_type="application/json")


@router.api_route("/ready", methods=["GET", "HEAD"])
async def ready(request: Request) -> Response:
    """Readiness: 200 only while every model a replica serves has a ready, undrained replica (the monitors' view,
    confirmed where this worker has not learned a replica's model yet), Redis answers and the gateway is not
    draining. The body lists every replica's state."""
    services = get_services(request)
    readiness: Readiness = request.app.state.readiness
    await services.pool.confirm()
    engine_reason = services.pool.not_ready_reason()
    redis_reason = await readiness.redis(services.check_redis)
    ready = engine_reason is None and redis_reason is None and not readiness.draining
    views = services.pool.views()
    models = sorted({view.model for view in views if view.model is not None and view.ready})
    body: dict[str, object] = {
        "status": "ready" if ready else "draining" if readiness.draining else "not_ready",
        "draining": readiness.draining,
        "engine": {"ok": engine_reason is None, "reason": engine_reason},
        "redis": {"ok": redis_reason is None, "reason": redis_reason},
        "models": models,
        "replicas": [view.to_json() for view in views],
    }
    if models:
        body["model"] = models[0] if len(models) == 1 else models
    status = 200 if body["status"] == "ready" else 503
    headers = {} if status == 200 else {"Retry-After": str(int(services.settings.relay.retry_after))}
    return Response(orjson.dumps(body), status, headers=headers, media_type="application/json")
