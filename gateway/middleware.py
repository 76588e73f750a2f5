"""Pure-ASGI middleware: request id, in-flight gauge, per-request metrics and the access-log line.

Pure ASGI (not BaseHTTPMiddleware) so streamed bodies pass through unbuffered and a client
disconnect reaches the route. Never logs a key or the Authorization header.
"""

from __future__ import annotations

import logging
import os
import re
import time
from typing import Any

from gateway.metrics import GatewayMetrics
from gateway.relay.sse import Message, Receive, Send
from gateway.requestlog import RequestRecord

access_logger = logging.getLogger("gateway.access")

# A client's id is echoed into headers and logs: only accept something short and printable.
_VALID_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:\-]{1,128}")
# Routes with their own label; everything else is "other" (unknown paths must not grow label sets).
_ROUTES = frozenset(("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/ready", "/metrics"))
CLIENT_CLOSED_REQUEST = 499


def _request_id(scope: Message) -> str:
    for name, value in scope["headers"]:
        if name == b"x-request-id":
            if _VALID_REQUEST_ID.fullmatch(value):
                return str(value, "ascii")
            break
    return os.urandom(16).hex()


class RequestContextMiddleware:
    """Gives every request an id and a RequestRecord; records metrics and one access line at its end."""

    def __init__(self, app: Any, metrics: GatewayMetrics, *, access_log: bool = True) -> None:
        self.app = app
        self.metrics = metrics
        self.access_log = access_log
        # Labelled children looked up once: `.labels()` on every request showed in the profile.
        self._by_route: dict[tuple[str, int], tuple[Any, Any]] = {}

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        record = RequestRecord(request_id=_request_id(scope), started_at=started)
        scope.setdefault("state", {})["record"] = record
        id_header = (b"x-request-id", record.request_id.encode())
        status = 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", ()), id_header]
            await send(message)

        self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            self.metrics.in_flight.dec()
            if record.client_disconnected:
                status = CLIENT_CLOSED_REQUEST
            self._finish(scope, record, status, time.perf_counter() - started)

    def _finish(self, scope: Message, record: RequestRecord, status: int, duration: float) -> None:
        path = scope["path"]
        route = path if path in _ROUTES else "other"
        metrics = self.metrics
        children = self._by_route.get((route, status))
        if children is None:
            children = (metrics.requests.labels(route, str(status)), metrics.request_duration.labels(route))
            self._by_route[(route, status)] = children
        children[0].inc()
        children[1].observe(duration)
        ttft = None if record.first_chunk_at is None else record.first_chunk_at - record.started_at
        if ttft is not None:
            metrics.time_to_first_token.observe(ttft)
        if record.prompt_tokens is not None and record.completion_tokens is not None:
            metrics.tokens.labels("prompt").inc(record.prompt_tokens)
            metrics.tokens.labels("completion").inc(record.completion_tokens)
        if self.access_log and route != "/metrics":
            client = scope.get("client")
            access_logger.info(
                '%s "%s %s" %d %.1fms id=%s key=%s model=%s stream=%s tokens=%s/%s ttft=%s%s',
                client[0] if client else "-",
                scope["method"],
                path,
                status,
                duration * 1000,
                record.request_id,
                record.key_name or "-",
                record.model or "-",
                "yes" if record.stream else "no",
                "-" if record.prompt_tokens is None else record.prompt_tokens,
                "-" if record.completion_tokens is None else record.completion_tokens,
                "-" if ttft is None else f"{ttft * 1000:.1f}ms",
                f" engine_error={record.engine_error}" if record.engine_error else "",
            )
