"""Pure-ASGI middleware: request id, in-flight gauge, body read deadlines, per-request metrics, the access-log
line, and the forwarded client address.

Pure ASGI (not BaseHTTPMiddleware) so streamed bodies pass through unbuffered and a client
disconnect reaches the route. Never logs a key or the Authorization header; everything logged that a
client chose is escaped first. Imports settings, errors, metrics, request_record and types.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import os
import re
import time
from datetime import UTC, datetime
from typing import Any

import orjson
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from gateway.deadline import deadline
from gateway.errors import RequestTimeoutError
from gateway.metrics.instruments import GatewayMetrics
from gateway.request_record import RequestRecord
from gateway.settings import HttpSettings
from gateway.types import ASGIApp, Message, Receive, Scope, Send

access_logger = logging.getLogger("gateway.access")

# A client's id is echoed into headers and logs: only accept something short and printable.
_VALID_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:\-]{1,128}")
CLIENT_CLOSED_REQUEST = 499
# Where ForwardedClientMiddleware keeps the socket's peer while uvicorn's proxy middleware runs.
_PEER = "gateway.peer"
# Prometheus's scrapes (every few seconds) are not access-logged; probes (/health, /ready) only with `log_probes`.
_SCRAPES = frozenset(("/metrics", "/metrics/engine"))
_PROBES = frozenset(("/health", "/ready"))


def loggable(text: str) -> str:
    """`text` safe for one log line: control and other non-printable characters, quotes and backslashes
    escaped, so a client cannot forge or colour log lines (CR/LF, ANSI escapes in a path)."""
    if text.isprintable() and '"' not in text and "\\" not in text:
        return text
    return "".join(_escape(ch) for ch in text)


def _escape(ch: str) -> str:
    if ch == '"' or ch == "\\":
        return "\\" + ch
    if ch.isprintable():
        return ch
    return ch.encode("unicode_escape").decode("ascii")


def _request_id(scope: Scope) -> str:
    for name, value in scope["headers"]:
        if name == b"x-request-id":
            if _VALID_REQUEST_ID.fullmatch(value):
                return str(value, "ascii")
            break
    return os.urandom(16).hex()


def _bounded_body(receive: Receive, http: HttpSettings) -> Receive:
    """`receive` with deadlines while the request body arrives: `body_chunk_timeout` between two chunks and
    `body_timeout` for all of it; afterwards (watching for a disconnect) it is `receive` itself.

    A late body raises RequestTimeoutError (408, `Connection: close`) inside the reading route, so the client
    gets an envelope and the access log says 408.
    """
    loop = asyncio.get_running_loop()
    body_due = loop.time() + http.body_timeout
    done = False

    async def receive_body() -> Message:
        nonlocal done
        if done:
            return await receive()
        try:
            async with deadline(min(http.body_chunk_timeout, body_due - loop.time())):
                message = await receive()
        except TimeoutError:
            done = True
            raise RequestTimeoutError(
                f"The request body arrived too slowly (limits: {http.body_chunk_timeout:g} s between chunks, "
                f"{http.body_timeout:g} s in all); send it at once.",
                headers={"Connection": "close"},
            ) from None
        if message["type"] != "http.request" or not message.get("more_body", False):
            done = True
        return message

    return receive_body


class RequestContextMiddleware:
    """Gives every request an id and a RequestRecord; records metrics and one access line at its end."""

    def __init__(
        self,
        app: ASGIApp,
        metrics: GatewayMetrics,
        *,
        routes: frozenset[str],
        http: HttpSettings,
        access_log: bool = True,
        log_probes: bool = False,
        log_format: str = "text",
    ) -> None:
        self.app = app
        self.metrics = metrics
        # Served paths get their own label; everything else is "other" (unknown paths must not grow label sets).
        self.routes = routes
        self.http = http
        self.access_log = access_log
        self._unlogged = _SCRAPES if log_probes else _SCRAPES | _PROBES
        self._log = _json_line if log_format == "json" else _text_line
        # Labelled children looked up once: `.labels()` on every request showed in the profile.
        self._by_route: dict[tuple[str, int], tuple[Any, Any]] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        record = RequestRecord(request_id=_request_id(scope), started_at=started)
        scope.setdefault("state", {})["record"] = record
        id_header = (b"x-request-id", record.request_id.encode())
        status = 500
        finished = False
        ended = started

        def finish() -> None:
            nonlocal finished, status, ended
            if finished:
                return
            finished = True
            self.metrics.in_flight.dec()
            ended = time.perf_counter()
            status = CLIENT_CLOSED_REQUEST if record.client_disconnected else status
            self._finish(scope, record, status, ended - started)

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", ()), id_header]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                # Counted before the last byte goes out: a client that has its whole answer and then scrapes
                # /metrics (of this worker or another one) finds the request counted and no longer in flight.
                finish()
            await send(message)

        self.metrics.in_flight.inc()
        try:
            await self.app(scope, _bounded_body(receive, self.http), send_with_id)
        finally:
            finish()  # an answer that never got its last byte out (an error, a client gone)
            if record.trace is not None:  # its spans are built once the client has the whole answer
                record.trace.end(record, status, ended)

    def _finish(self, scope: Scope, record: RequestRecord, status: int, duration: float) -> None:
        path = scope["path"]
        # The dispatcher names the served row (a template for a path with an id); other paths are "other".
        route = record.route or (path if path in self.routes else "other")
        metrics = self.metrics
        children = self._by_route.get((route, status))
        if children is None:
            children = (metrics.requests.labels(route, str(status)), metrics.request_duration.labels(route))
            self._by_route[(route, status)] = children
        children[0].inc()
        children[1].observe(duration)
        ttft = None if record.first_chunk_at is None else record.first_chunk_at - record.started_at
        completion = record.completion_tokens
        inter_token = None
        if ttft is not None:
            metrics.time_to_first_token.observe(ttft)
            if record.stream and completion is not None and completion > 1:
                inter_token = (duration - ttft) / (completion - 1)
                metrics.inter_token_latency.observe(inter_token)
        if record.prompt_tokens is not None and completion is not None:
            metrics.tokens.labels("prompt").inc(record.prompt_tokens)
            metrics.tokens.labels("completion").inc(completion)
        if record.replica is not None:
            metrics.count_replica(
                record.model or "",
                record.replica,
                status,
                duration,
                ttft,
                record.prompt_tokens,
                completion,
                inter_token,
            )
        if record.api is not None:
            metrics.count_api(record.api, status, record.prompt_tokens, completion, record.reasoning_tokens)
        if record.key_name is not None:
            metrics.count_key(record.key_name, status, record.prompt_tokens, completion)
        if status == 429:
            metrics.rate_limited.labels(record.cause or "requests").inc()
        elif status == 401:
            metrics.auth_failures.labels(record.cause or "invalid").inc()
        if self.access_log and route not in self._unlogged:
            self._log(scope, record, status, duration, ttft)


def _emit(message: str, *args: object) -> None:
    """`access_logger.info(message, *args)` less its search of the stack for the caller's file and line, which no
    line shows (a fifth of what logging one access line cost)."""
    if access_logger.isEnabledFor(logging.INFO):
        access_logger.handle(access_logger.makeRecord(access_logger.name, logging.INFO, "", 0, message, args, None))


def _text_line(scope: Scope, record: RequestRecord, status: int, duration: float, ttft: float | None) -> None:
    client = scope.get("client")
    _emit(
        '%s "%s %s" %d %.1fms id=%s key=%s model=%s replica=%s stream=%s tokens=%s/%s ttft=%s api=%s%s%s',
        loggable(client[0]) if client else "-",
        loggable(scope["method"]),
        loggable(scope["path"]),
        status,
        duration * 1000,
        record.request_id,
        loggable(record.key_name) if record.key_name else "-",
        loggable(record.model) if record.model else "-",
        record.replica or "-",
        "yes" if record.stream else "no",
        "-" if record.prompt_tokens is None else record.prompt_tokens,
        "-" if record.completion_tokens is None else record.completion_tokens,
        "-" if ttft is None else f"{ttft * 1000:.1f}ms",
        record.api or "-",
        f" engine_error={record.engine_error}" if record.engine_error else "",
        "" if record.trace is None else f" trace={record.trace.trace_id:032x}",
    )


def _json_line(scope: Scope, record: RequestRecord, status: int, duration: float, ttft: float | None) -> None:
    """One JSON object: what a log shipper indexes. JSON escaping keeps a client's text from forging lines; the
    prompt and any key material are never in it."""
    client = scope.get("client")
    line = {
        "time": datetime.now(UTC).isoformat(timespec="milliseconds"),
        "request_id": record.request_id,
        "key": record.key_name,
        "model": record.model,
        "replica": record.replica,
        "method": scope["method"],
        "route": scope["path"],
        "api": record.api,
        "status": status,
        "stream": record.stream,
        "prompt_tokens": record.prompt_tokens,
        "completion_tokens": record.completion_tokens,
        "reasoning_tokens": record.reasoning_tokens,
        "ttft_ms": None if ttft is None else round(ttft * 1000, 1),
        "duration_ms": round(duration * 1000, 1),
        "client": client[0] if client else None,
        "disconnected": record.client_disconnected,
        "engine_error": record.engine_error,
        "cause": record.cause,
        "trace_id": None if record.trace is None else f"{record.trace.trace_id:032x}",
    }
    _emit("%s", orjson.dumps(line).decode())


@functools.lru_cache(maxsize=4096)
def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class ForwardedClientMiddleware:
    """The client address from `X-Forwarded-For` when the peer is a trusted proxy, as uvicorn's proxy-headers
    middleware reads it, but only when it is an IPv4 or IPv6 address: anything else (`evil`, a forged log
    line) keeps the peer's address, so the failed-auth guard and the access log key on real addresses."""

    def __init__(self, app: ASGIApp, trusted_hosts: str) -> None:
        self.app = app
        self._proxy = ProxyHeadersMiddleware(self._checked, trusted_hosts)  # type: ignore[arg-type]  # uvicorn's TypedDict ASGI types

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope[_PEER] = scope.get("client")
        await self._proxy(scope, receive, send)  # type: ignore[arg-type]  # uvicorn's TypedDict ASGI types

    async def _checked(self, scope: Scope, receive: Receive, send: Send) -> None:
        peer = scope.pop(_PEER, None)
        client = scope.get("client")
        if client is not peer and client is not None and not _is_address(client[0]):
            scope["client"] = peer
        await self.app(scope, receive, send)
