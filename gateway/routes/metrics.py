"""/metrics: the gateway's Prometheus registry in the text exposition format."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.deps import get_services

router = APIRouter()


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus scrape endpoint (bind or firewall it to the monitoring network in production)."""
    registry = get_services(request).metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
