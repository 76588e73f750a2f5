"""FastAPI dependencies: the app's services and settings for route handlers."""

from __future__ import annotations

from fastapi import Request

from gateway.requestlog import RequestRecord
from gateway.services import Services


def get_services(request: Request) -> Services:
    """The app's services (built in the lifespan)."""
    services: Services = request.app.state.services
    return services


def get_record(request: Request) -> RequestRecord:
    """This request's record, created by the middleware."""
    record: RequestRecord = request.scope["state"]["record"]
    return record
