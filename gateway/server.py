"""The gateway's HTTP server: uvicorn with httptools, bounded in what one client may cost (issue 12).

`serve(settings)` builds the app and runs it until SIGTERM/SIGINT. `GuardedHttpToolsProtocol` caps the
request head (431), gives it a deadline (408, then close), closes a body still arriving after its
deadline, and refuses connections beyond a cap at accept (503); the 408 for a slow body is answered by
the middleware, where the route reads it. Under systemd socket activation it serves the inherited listening
socket, so connections wait in the kernel's queue while one gateway process replaces another (issue 10);
from a stop signal on, /ready answers 503 (draining). Imports the app (this is where it runs), settings and
errors.
"""

from __future__ import annotations

import asyncio
import functools
import http
import json
import logging
import resource
import socket
import time
from asyncio import TimerHandle
from dataclasses import dataclass
from types import FrameType
from typing import Any

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from gateway.app import create_app
from gateway.errors import (
    GatewayError,
    MalformedRequestError,
    OverloadedError,
    RequestHeadTooLargeError,
    RequestTimeoutError,
)
from gateway.multiproc import forget_worker
from gateway.relay.shared import SharedEngineState
from gateway.relay.sse import BODY_WRITER
from gateway.settings import Settings, inherited_listen_fd
from gateway.workers import STARTUP_FAILURE, WorkerPool, usable_cores

logger = logging.getLogger(__name__)

# File descriptors kept free beyond the engine and Redis pools: logs, the listening socket, probes.
_FD_HEADROOM = 64
# A refused or cut-off client is logged at most this often (with a count), so a flood cannot flood the log.
_LOG_EVERY = 10.0
# How long a refused or cut-off connection lingers half-closed, so the client reads its answer, not a reset.
_REFUSAL_LINGER = 1.0
# A connection idle when the gateway starts draining stays open this long for a request the client may be
# sending at that very moment, which is then answered with `Connection: close` (issue 10).
_DRAIN_IDLE = 1.0
# uvicorn's default listen backlog, for the workers' shared socket as for its own.
_BACKLOG = 2048


def default_max_connections(settings: Settings) -> int:
    """The connection cap when `http.max_connections` is unset: the open-file limit less the gateway's own
    needs (engine and Redis pools, a little headroom), but at least half the limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    reserve = settings.relay.max_connections + settings.redis.max_connections + _FD_HEADROOM
    return max(soft - reserve, soft // 2)


class _ThrottledLog:
    """Counts events of one kind and logs a warning about them at most once per `_LOG_EVERY` seconds."""

    def __init__(self, message: str) -> None:
        self._message = message
        self._count = 0
        self._logged_at = -_LOG_EVERY

    def event(self, *args: object) -> None:
        self._count += 1
        now = time.monotonic()
        if now - self._logged_at >= _LOG_EVERY:
            logger.warning(self._message, self._count, *args)
            self._count = 0
            self._logged_at = now


@dataclass(frozen=True, slots=True)
class ClientLimits:
    """What one client connection may cost, shared by every connection of a server."""

    max_head_bytes: int
    head_timeout: float
    body_timeout: float
    max_connections: int
    refusals: _ThrottledLog
    slow_heads: _ThrottledLog
    slow_bodies: _ThrottledLog
    large_heads: _ThrottledLog
    malformed: _ThrottledLog

    @classmethod
    def from_settings(cls, settings: Settings) -> ClientLimits:
        cap = settings.http.max_connections or default_max_connections(settings)
        return cls(
            max_head_bytes=settings.http.max_head_bytes,
            head_timeout=settings.http.head_timeout,
            # The middleware answers a late body with 408 at `body_timeout`; this closes what it cannot reach.
            body_timeout=settings.http.body_timeout + 1.0,
            max_connections=cap,
            refusals=_ThrottledLog(f"refused %d connection(s): the gateway holds its cap of {cap} connections"),
            slow_heads=_ThrottledLog("closed %d connection(s) whose request head took longer than %g s"),
            slow_bodies=_ThrottledLog("closed %d connection(s) whose request body took longer than %g s"),
            large_heads=_ThrottledLog("refused %d request(s) with a head over %d bytes (431)"),
            malformed=_ThrottledLog("refused %d malformed request(s) (400), the last: %s"),
        )


class ServerConfig(uvicorn.Config):
    """uvicorn's Config carrying the gateway's client limits to every protocol instance it creates."""

    def __init__(self, app: Any, *, limits: ClientLimits, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.limits = limits


def _raw_response(error: GatewayError) -> bytes:
    """`error` as a complete HTTP/1.1 response in OpenAI's envelope that closes the connection."""
    body = error.to_json()
    lines = [f"HTTP/1.1 {error.status_code} {http.HTTPStatus(error.status_code).phrase}"]
    lines += ["content-type: application/json", f"content-length: {len(body)}", "connection: close"]
    lines += [f"{name}: {value}" for name, value in error.headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class ChunkWriter:
    """Writes a chunk of one response's body straight to its connection, as uvicorn's `send` would, or says it
    cannot (the client is gone, its buffer is full, the response is not chunked); the SSE relay then uses `send`.

    Offered in the scope under `BODY_WRITER` so the relay can write a chunk from the engine connection's data
    callback, below ASGI's per-message path (issue 11). Body chunks carry nothing the middleware reads.
    """

    __slots__ = ("_cycle",)

    def __init__(self, cycle: RequestResponseCycle) -> None:
        self._cycle = cycle

    def write(self, body: bytes) -> bool:
        cycle = self._cycle
        if (
            cycle.disconnected
            or cycle.transport.is_closing()  # closed by the server itself: uvloop refuses writes at once
            or cycle.flow.write_paused
            or not cycle.response_started
            or cycle.response_complete
            or not cycle.chunked_encoding
        ):
            return False
        cycle.transport.write(b"%x\r\n%b\r\n" % (len(body), body))
        return True


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol (its speed kept) with the limits httptools lacks: a head-size cap, a
    head deadline, a body backstop and a connection cap. Everything else is uvicorn's."""

    def __init__(self, config: uvicorn.Config, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        assert isinstance(config, ServerConfig)
        self._limits = config.limits
        self._head_open = False  # a request head has begun and is not complete yet
        self._head_bytes = 0  # bytes of that head counted so far (see data_received)
        self._head_timer: TimerHandle | None = None
        self._body_timer: TimerHandle | None = None
        self._linger: TimerHandle | None = None
        self._done = False  # refused or cut off: ignore whatever else arrives
        self._draining = False  # the server is stopping: answer what arrives with `Connection: close`

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if len(self.connections) >= self._limits.max_connections:
            self._refuse(transport)
            return
        super().connection_made(transport)  # type: ignore[arg-type]  # uvicorn narrows it to asyncio.Transport
        self._start_head_timer()

    def _refuse(self, transport: asyncio.BaseTransport) -> None:
        # Answered before reading anything: the whole point is to spend nothing on this client.
        self.transport = transport  # type: ignore[assignment]  # uvloop's transports are not asyncio.Transport subclasses
        self._limits.refusals.event()
        self._close(OverloadedError("The gateway has too many open connections; retry shortly.", retry_after=1.0))

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        super().connection_lost(exc)

    def shutdown(self) -> None:
        """The server drains. uvicorn closes an idle keep-alive connection at once, which loses a request the
        client is sending at that moment (a POST it must not resend); here such a connection gets `_DRAIN_IDLE`
        seconds: a request that arrives is answered with `Connection: close`, silence closes it."""
        self._draining = True
        if self._finished():
            return
        if not self._idle():
            super().shutdown()  # a response is going out: it ends with `Connection: close`
        elif not self._head_open:
            self._linger = self.loop.call_later(_DRAIN_IDLE, self._close_if_idle)

    def _close_if_idle(self) -> None:
        self._linger = None
        if self._idle() and not self._head_open and not self.transport.is_closing():
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._done:
            return
        # A head only grows across calls: count whole chunks that arrive while one is open (the chunk it
        # began in is not counted, which errs towards admitting) and stop before httptools buffers it all.
        # The exact size is checked when the head is complete.
        head_was_open = self._head_open
        self._feed(data)
        if self._finished():
            return
        if head_was_open and self._head_open:
            self._head_bytes += len(data)
            if self._head_bytes > self._limits.max_head_bytes:
                self._reject_head(self._head_bytes)
                return
        if self._head_timer is None and not self._head_open and self._idle():
            # Bytes that begin no request (blank lines) must not keep a connection open forever either.
            self._start_head_timer()

    def _feed(self, data: bytes) -> None:
        # uvicorn's data_received, except for bytes httptools cannot parse: uvicorn logs a warning for each such
        # request and answers in text/plain; here the log is throttled and the answer is a 400 in the envelope.
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            reason = str(exc)[:100] or type(exc).__name__
            self._limits.malformed.event(reason)
            self._malformed(MalformedRequestError(f"The request is not valid HTTP/1.1 ({reason}); fix it and resend."))
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()

    def _malformed(self, error: MalformedRequestError) -> None:
        cycle: RequestResponseCycle | None = self.cycle
        if cycle is not None and not cycle.response_complete:
            if not cycle.more_body:
                # The bad bytes follow a complete request (pipelined): answer that one, then close.
                self._done = True
                cycle.keep_alive = False
                self.flow.pause_reading()
                return
            if cycle.response_started:
                self._close(None)  # never written into a response going out
                return
        self._close(error)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_open = True
        self._head_bytes = 0
        if self._head_timer is None:
            self._start_head_timer()

    def on_headers_complete(self) -> None:
        if self._done:
            return
        self._head_open = False
        self._cancel_head_timer()
        size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
        if size > self._limits.max_head_bytes:
            self._reject_head(size)
            return
        super().on_headers_complete()
        if self._draining:
            self.cycle.keep_alive = False
        self.scope[BODY_WRITER] = ChunkWriter(self.cycle)  # type: ignore[literal-required]  # our own scope key
        self._body_timer = self.loop.call_later(self._limits.body_timeout, self._body_timed_out)

    def on_body(self, body: bytes) -> None:
        if not self._done:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._done:
            return
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        super().on_message_complete()

    def _finished(self) -> bool:
        # A method, not an inline test: the parser's callbacks may set `_done` during `data_received`.
        return self._done or self.transport.is_closing()

    def _idle(self) -> bool:
        cycle: RequestResponseCycle | None = self.cycle  # None until the first head is complete
        return (cycle is None or cycle.response_complete) and not self.pipeline

    def _start_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self._limits.head_timeout, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _cancel_timers(self) -> None:
        self._cancel_head_timer()
        for timer in (self._body_timer, self._linger):
            if timer is not None:
                timer.cancel()
        self._body_timer = self._linger = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        self._limits.slow_heads.event(self._limits.head_timeout)
        if not self._idle():
            # A response is still going out (a pipelined head is slow): finish it, read nothing more, close.
            self.cycle.keep_alive = False
            self.flow.pause_reading()
            return
        error = RequestTimeoutError(
            f"The request head did not arrive within {self._limits.head_timeout:g} s; send it at once."
        )
        self._close(error if self._head_open else None)

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if not self.transport.is_closing():
            self._limits.slow_bodies.event(self._limits.body_timeout)
            self._close(None)

    def _reject_head(self, size: int) -> None:
        self._limits.large_heads.event(self._limits.max_head_bytes)
        error = RequestHeadTooLargeError(
            f"The request line and headers are {size}+ bytes; the limit is {self._limits.max_head_bytes} bytes."
        )
        self._close(error if self._idle() else None)

    def _close(self, error: GatewayError | None) -> None:
        """Answer `error` (when nothing else is being answered) and close; what else arrives is discarded."""
        self._done = True
        self._cancel_timers()
        if error is None or not self.transport.can_write_eof():
            if error is not None:
                self.transport.write(_raw_response(error))
            self.transport.close()
            return
        # Closing a socket with unread input sends a reset, which can destroy the answer before the client
        # reads it; so shut the write side and close a moment later, or when the client closes.
        self.transport.write(_raw_response(error))
        self.transport.write_eof()
        self._linger = self.loop.call_later(_REFUSAL_LINGER, self.transport.close)


class DrainingServer(uvicorn.Server):
    """uvicorn's Server that marks the app as draining the moment a stop signal arrives, so /ready answers 503
    to whoever still asks on an open connection; uvicorn then closes the listening socket and lets open
    requests finish within `timeout_graceful_shutdown`."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler only records (the loop acts): one attribute set, read by the /ready route.
        app: Any = self.config.app  # the FastAPI app `serve` built; uvicorn types it as any ASGI app
        app.state.readiness.draining = True
        super().handle_exit(sig, frame)


def listening_sockets() -> list[socket.socket] | None:
    """The listening socket systemd passed (socket activation), or None to bind `host:port` as usual."""
    fd = inherited_listen_fd()
    if fd is None:
        return None
    sock = socket.socket(fileno=fd)  # family and type read from the descriptor
    logger.info("serving the listening socket systemd passed (fd %d, %s)", fd, sock.getsockname())
    return [sock]


def serve(settings: Settings) -> int:
    """Run the gateway until SIGTERM/SIGINT (open streams get `shutdown_grace` to finish): one process, or with
    `workers` > 1 a `WorkerPool` of processes sharing one listening socket (the default: one per usable core)."""
    logger.info("effective settings: %s", json.dumps(settings.masked()))
    limits = ClientLimits.from_settings(settings)
    workers = settings.workers or usable_cores()
    logger.info(
        "client limits: %d connections per worker, %d-byte heads within %g s, bodies within %g s",
        limits.max_connections,
        limits.max_head_bytes,
        limits.head_timeout,
        settings.http.body_timeout,
    )
    inherited = listening_sockets()
    if workers == 1:
        return serve_socket(settings, limits, inherited[0] if inherited else None)
    try:
        sock = inherited[0] if inherited else listen(settings.host, settings.port)
    except OSError as exc:
        logger.error("cannot listen on %s:%d: %s", settings.host, settings.port, exc)
        return STARTUP_FAILURE
    # Made before the fork, so the workers share one view of the engine (see gateway/relay/shared.py).
    shared = SharedEngineState()
    target = functools.partial(serve_socket, settings, limits, shared=shared)
    # A dead worker's in-flight gauge must not stay in the sum the others' scrapes report.
    pool = WorkerPool(
        workers,
        target,
        sock,
        drain=settings.shutdown_grace,
        on_exit=forget_worker,
        on_stop=shared.mark_draining,
    )
    return pool.run()


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on `host:port` that forked workers inherit (what uvicorn's own bind does)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(_BACKLOG)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def serve_socket(
    settings: Settings, limits: ClientLimits, sock: socket.socket | None, shared: SharedEngineState | None = None
) -> int:
    """Build the app and run it under uvicorn, on `sock` or (None) on a socket of its own; the exit code. `shared`:
    the engine view of the pool this worker belongs to."""
    config = ServerConfig(
        create_app(settings, shared),
        limits=limits,
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http=GuardedHttpToolsProtocol,
        lifespan="on",
        access_log=False,
        log_config=None,
        # The app's ForwardedClientMiddleware reads X-Forwarded-For, and only believes addresses.
        proxy_headers=False,
        timeout_graceful_shutdown=int(settings.shutdown_grace),
        server_header=False,
        backlog=_BACKLOG,
    )
    server = DrainingServer(config)
    server.run(sockets=None if sock is None else [sock])
    return 0 if server.started else STARTUP_FAILURE
