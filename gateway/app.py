"""The composition root: create_app(settings) builds the FastAPI app, its lifespan, middleware and handlers.

Nothing imports this module but `gateway.http.server`, which runs it under uvicorn.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from starlette.requests import ClientDisconnect

from gateway import __version__
from gateway.api import RouteTable, health, relayed, scrape
from gateway.api.background import BackgroundRuns
from gateway.api.validation import param_path
from gateway.errors import GatewayError, InternalError, InvalidRequestError
from gateway.http.middleware import ForwardedClientMiddleware, RequestContextMiddleware
from gateway.metrics.instruments import GatewayMetrics
from gateway.relay.readiness import SharedPoolState
from gateway.services import Services
from gateway.settings import Settings
from gateway.types import Receive, Scope, Send

logger = logging.getLogger(__name__)


def _error_response(error: GatewayError, body: bytes | None = None) -> Response:
    content = error.to_json() if body is None else body
    return Response(content, error.status_code, headers=error.headers, media_type="application/json")


async def _on_gateway_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, GatewayError)
    request.scope["state"]["record"].cause = exc.cause
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


class _Dispatcher:
    """Every request against the route table: the relayed APIs to the one relay handler and the stored-response
    routes to theirs, the other served routes to FastAPI, anything else a 404 or 405 (in the envelope of the API
    whose path it lies under, else OpenAI's).

    Starlette's routing layers cost ~14% of the gateway's CPU per request (loadtest profile); the hot routes
    skip them. Their errors come in the row's envelope (OpenAI's, or Anthropic's on the Messages routes); the
    dispatcher names the row and its API on the request record, for the metrics and the access log.
    """

    def __init__(self, app: Any, metrics: GatewayMetrics, table: RouteTable) -> None:
        self.app = app
        self.metrics = metrics
        self.table = table

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = self.table.find(scope["method"], scope["path"])
        if route is None:
            refusal = self.table.refusal(scope["method"], scope["path"])
            body = self.table.render_refusal(scope["path"], refusal)
            await _error_response(refusal, body)(scope, receive, send)
            return
        record = scope["state"]["record"]
        record.route, record.api = route.path, route.api
        if not route.hot:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive, send)
        try:
            if route.relayed is not None:
                response = await relayed.relay(request, route.relayed)
            else:
                assert route.handler is not None
                response = await route.handler(request)
        except GatewayError as exc:
            record.cause = exc.cause
            response = _error_response(exc, route.render(exc))
        except ClientDisconnect:
            # The client hung up while sending its body: nobody to answer, nothing went wrong here.
            scope["state"]["record"].client_disconnected = True
            self.metrics.client_disconnects.labels("upload").inc()
            response = Response(status_code=499)
        except Exception as exc:
            logger.exception("unhandled error in request %s", record.request_id, exc_info=exc)
            error = InternalError("The gateway failed to handle the request; it has been logged.")
            response = _error_response(error, route.render(error))
        await response(scope, receive, send)


def create_app(settings: Settings | None = None, shared: SharedPoolState | None = None) -> FastAPI:
    """Build the gateway app; `settings` defaults to the environment (and env file). `shared`: the engine view this
    process shares with the other workers of its gateway (made before they were forked), else one of its own."""
    settings = settings or Settings()
    engine_view = shared or SharedPoolState()
    gateway_metrics = GatewayMetrics(per_key=settings.metrics.per_key)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        services = Services.build(settings, gateway_metrics, engine_view)
        await services.start()
        app.state.services = services
        app.state.background = runs = BackgroundRuns(services)
        await runs.start()
        logger.info("nemotron-gateway %s serving, engine %s", __version__, settings.engine_url)
        try:
            yield
        finally:
            await runs.stop()
            await services.stop()

    app = FastAPI(
        title="nemotron-gateway",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.include_router(relayed.router)
    app.include_router(health.router)
    app.include_router(scrape.router)
    app.add_exception_handler(GatewayError, _on_gateway_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(Exception, _on_unexpected_error)
    table = RouteTable()
    app.state.readiness = health.Readiness(engine_view)
    app.add_middleware(_Dispatcher, metrics=gateway_metrics, table=table)
    app.add_middleware(
        RequestContextMiddleware,
        metrics=gateway_metrics,
        routes=table.paths,
        access_log=settings.access_log,
        log_probes=settings.log_probes,
        log_format=settings.log_format,
        http=settings.http,
    )
    # Outermost: the access log and the failed-auth guard must see the forwarded client address.
    app.add_middleware(ForwardedClientMiddleware, trusted_hosts=settings.trusted_proxies)
    return app
