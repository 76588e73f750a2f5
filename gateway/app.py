"""The composition root: create_app(settings) builds the FastAPI app, its lifespan, middleware and handlers.

Nothing imports this module; `gateway.cli` and uvicorn reach it by name.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError

from gateway import __version__
from gateway.errors import GatewayError, InternalError, InvalidRequestError, RouteNotFoundError
from gateway.metrics import GatewayMetrics
from gateway.middleware import RequestContextMiddleware
from gateway.routes import health, metrics, openai
from gateway.services import Services
from gateway.settings import Settings
from gateway.validation import param_path

logger = logging.getLogger(__name__)

_SERVED = "POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health, GET /ready, GET /metrics"


def _error_response(error: GatewayError) -> Response:
    return Response(error.to_json(), error.status_code, headers=error.headers, media_type="application/json")


async def _on_gateway_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, GatewayError)
    return _error_response(exc)


async def _on_validation_error(request: Request, exc: Exception) -> Response:
    # FastAPI's 422 and its body shape must never reach a client.
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0] if exc.errors() else {}
    param = param_path(tuple(first.get("loc", ()))) or None
    return _error_response(InvalidRequestError(f"Invalid request: {first.get('msg', 'malformed')}.", param=param))


async def _on_unexpected_error(request: Request, exc: Exception) -> Response:
    record = request.scope.get("state", {}).get("record")
    logger.exception("unhandled error in request %s", record.request_id if record else "-", exc_info=exc)
    return _error_response(InternalError("The gateway failed to handle the request; it has been logged."))


async def _unknown_route(request: Request) -> Response:
    raise RouteNotFoundError(f"{request.method} {request.url.path} is not served here; the gateway serves {_SERVED}.")


class _CompletionRoutes:
    """POST /v1/chat/completions and /v1/completions straight to their handlers.

    Starlette's routing layers cost ~14% of the gateway's CPU per request (loadtest profile); the two
    hot routes skip them. Errors are answered exactly as the app's handlers answer them.
    """

    def __init__(self, app: Any) -> None:
        self.app = app
        self.routes = {"/v1/chat/completions": openai.chat_completions, "/v1/completions": openai.completions}

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        handler = self.routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if handler is None:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive, send)
        try:
            response = await handler(request)
        except GatewayError as exc:
            response = _error_response(exc)
        except Exception as exc:
            response = await _on_unexpected_error(request, exc)
        await response(scope, receive, send)


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the gateway app; `settings` defaults to the environment (and env file)."""
    settings = settings or Settings()
    gateway_metrics = GatewayMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        services = Services.build(settings, gateway_metrics)
        await services.start()
        app.state.services = services
        logger.info("nemotron-gateway %s serving, engine %s", __version__, settings.engine_url)
        try:
            yield
        finally:
            await services.stop()

    app = FastAPI(
        title="nemotron-gateway",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.include_router(openai.router)
    app.include_router(health.router)
    app.include_router(metrics.router)
    app.add_route("/{path:path}", _unknown_route, methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"])
    app.add_exception_handler(GatewayError, _on_gateway_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(Exception, _on_unexpected_error)
    app.add_middleware(_CompletionRoutes)
    app.add_middleware(RequestContextMiddleware, metrics=gateway_metrics, access_log=settings.access_log)
    return app
