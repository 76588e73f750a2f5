"""/health (the process is alive) and /ready (engine and Redis answer; else 503 saying which is down)."""

from __future__ import annotations

import asyncio

import orjson
from fastapi import APIRouter, Request, Response

from gateway.deps import get_services

router = APIRouter()


@router.get("/health")
async def health() -> Response:
    """Liveness: answers while the process serves requests at all."""
    return Response(b'{"status":"ok"}', media_type="application/json")


@router.get("/ready")
async def ready(request: Request) -> Response:
    """Readiness: 200 only when the engine's /health and Redis both answer now."""
    services = get_services(request)
    engine_reason, redis_reason = await asyncio.gather(services.monitor.check(), services.check_redis())
    body = {
        "status": "ready" if engine_reason is None and redis_reason is None else "not_ready",
        "engine": {"ok": engine_reason is None, "reason": engine_reason},
        "redis": {"ok": redis_reason is None, "reason": redis_reason},
    }
    if services.monitor.model is not None:
        body["model"] = services.monitor.model.name
    status = 200 if body["status"] == "ready" else 503
    headers = {} if status == 200 else {"Retry-After": str(int(services.settings.relay.retry_after))}
    return Response(orjson.dumps(body), status, headers=headers, media_type="application/json")
