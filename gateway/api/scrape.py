"""/metrics (the gateway's Prometheus registry) and /metrics/engine (the engine's own, relayed from 127.0.0.1).

Both answer only scrapes from the allowed networks or with the metrics token (`exposition.ScrapeAccess`).
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from gateway.api.context import get_services
from gateway.errors import RouteNotFoundError

router = APIRouter()


def _checked(request: Request) -> None:
    client = request.client
    get_services(request).exposition.access.check(client.host if client else None, request.headers.get("authorization"))


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """The gateway's metrics: requests, limits, engine errors, Redis, process and GPU figures."""
    _checked(request)
    body, media_type = await get_services(request).exposition.gateway()
    return Response(body, media_type=media_type)


@router.get("/metrics/engine")
async def engine_metrics(request: Request) -> Response:
    """vLLM's own metrics (`vllm:*`: queue, KV cache, its latency histograms), as the engine exposes them; with
    several replicas, every replica's, each sample labelled with its `replica` and `model`."""
    _checked(request)
    exposition = get_services(request).exposition
    if not exposition.engine_enabled:
        raise RouteNotFoundError("The engine's metrics are not relayed here (NEMOTRON_METRICS__ENGINE=false).")
    replicas = get_services(request).pool.replicas
    body, media_type = await exposition.engine([(r.url, r.model_name, r.client) for r in replicas])
    return Response(body, media_type=media_type)
