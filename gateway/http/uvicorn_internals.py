"""Every use the gateway makes of uvicorn's internals: the HTTP protocol, the chunk writer and the server loop.

Tested with uvicorn 0.54.0 (httptools 0.9.0, uvloop 0.23.0); `pyproject.toml` bounds uvicorn below 0.55, since
uvicorn 0.x may change any of this in a minor release. `INTERNALS` declares each name relied upon, and
tests/unit/test_library_internals.py checks them against the installed uvicorn, so an upgrade that drops one
fails a test, not a request. What is relied upon, beyond `uvicorn.Config` and `uvicorn.Server.run`:

- `uvicorn.protocols.http.httptools_impl.HttpToolsProtocol`, subclassed by `GuardedHttpToolsProtocol`, which
  overrides nine of its methods: `__init__`, `connection_made`, `connection_lost`, `shutdown`, `data_received`
  (re-implemented: it feeds `parser` after `_unset_keepalive_if_required`, and on an upgrade calls
  `_should_upgrade`, `handle_websocket_upgrade` or `_unsupported_upgrade_warning`), `on_message_begin`,
  `on_headers_complete`, `on_body`, `on_message_complete`; it reads `connections` (the server's set of open
  connections), `transport`, `loop`, `flow`, `cycle`, `pipeline`, `url` and `headers` (the head being parsed) and
  `scope`, which it also writes (the `BODY_WRITER` and `DISCONNECT_WATCH` keys). Its `__init__` takes the config
  first.
- `RequestResponseCycle`: `ConnectionWatch` reads `disconnected` (set by uvicorn's `connection_lost`);
  `ChunkWriter` reads `disconnected`, `transport`, `flow`, `response_started`, `response_complete` and
  `chunked_encoding`, and writes a chunk's framing (`<hex size>\\r\\n<body>\\r\\n`) to the
  transport as `RequestResponseCycle.send` would; the protocol reads `more_body`, `response_started` and
  `response_complete` and writes `keep_alive` (False: the response ends with `Connection: close`).
- `uvicorn.protocols.http.flow_control.FlowControl`: `write_paused` read, `pause_reading` called.
- `uvicorn.Server`, subclassed by `DrainingServer`: `handle_exit` and `main_loop` overridden; `main_loop` calls
  `on_tick(0)` (uvicorn does its once-a-second work, the Date header, when the counter is 0 modulo 10, and
  returns whether to exit); `config` and `started` read.
- `uvicorn.Config`, subclassed by `ServerConfig`: `__init__` overridden (the client limits and whether to freeze
  the heap once started ride along); `app` read (the app the server runs).

Imports settings-derived limits (`gateway.http.client_limits`), errors and the relay's scope key for the writer.
"""

from __future__ import annotations

import asyncio
import gc
import http
import weakref
from asyncio import TimerHandle
from collections.abc import Callable
from types import FrameType
from typing import Any

import httptools
import uvicorn
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from gateway.errors import (
    GatewayError,
    MalformedRequestError,
    OverloadedError,
    RequestHeadTooLargeError,
    RequestTimeoutError,
)
from gateway.http.client_limits import ClientLimits
from gateway.relay.disconnect import DISCONNECT_WATCH
from gateway.relay.sse import BODY_WRITER
from gateway.types import LibraryInternals

# How long a refused or cut-off connection lingers half-closed, so the client reads its answer, not a reset.
_REFUSAL_LINGER = 1.0
# A connection idle when the gateway starts draining stays open this long for a request the client may be
# sending at that very moment, which is then answered with `Connection: close` (a POST it must not resend).
_DRAIN_IDLE = 1.0
# Seconds between two housekeeping ticks of a worker's uvicorn loop (the Date header); a stop signal needs none.
_TICK = 1.0


class ServerConfig(uvicorn.Config):
    """uvicorn's Config carrying the gateway's client limits to every protocol instance it creates."""

    def __init__(self, app: Any, *, limits: ClientLimits, freeze_heap: bool = False, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.limits = limits
        # The serving process's own (not a test's): once started, take what it holds for good out of the
        # collector's scans (`DrainingServer.main_loop`).
        self.freeze_heap = freeze_heap
        # Set by the stop signal: a connection whose `connection_made` runs after uvicorn asked the open ones to
        # drain (accepted in the loop pass that stopped listening) drains too, instead of staying keep-alive
        # until the grace ends and the process exits under a request.
        self.draining = False


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
    callback, below ASGI's per-message path (no task wake-up, no send through the middleware chain). Body chunks
    carry nothing the middleware reads.
    """

    __slots__ = ("_cycle",)

    def __init__(self, cycle: RequestResponseCycle) -> None:
        # Weakly: the cycle's scope holds this writer, and a strong reference back made every request a reference
        # cycle (scope, record and all) that only the garbage collector freed.
        self._cycle = weakref.ref(cycle)

    def write(self, body: bytes) -> bool:
        cycle = self._cycle()
        if (
            cycle is None
            or cycle.disconnected
            or cycle.transport.is_closing()  # closed by the server itself: uvloop refuses writes at once
            or cycle.flow.write_paused
            or not cycle.response_started
            or cycle.response_complete
            or not cycle.chunked_encoding
        ):
            return False
        cycle.transport.write(b"%x\r\n%b\r\n" % (len(body), body))
        return True


class ConnectionWatch:
    """Tells the request being served on a connection that its client disconnected (a `relay.disconnect`
    `DisconnectWatch`): the protocol calls `lost()` from `connection_lost`, which calls back what the request armed.

    Offered in the scope under `DISCONNECT_WATCH`, so an engine exchange is cancelled when its client leaves without
    a task reading `receive` beside it (which cost two tasks and a wait per request). Like uvicorn's own disconnect,
    it reaches the connection's latest request: one whose successor was pipelined behind it is not told.
    """

    __slots__ = ("_callback", "_cycle")

    def __init__(self, cycle: RequestResponseCycle) -> None:
        self._cycle = weakref.ref(cycle)  # weakly, as `ChunkWriter`: the cycle's scope holds this watch
        self._callback: Callable[[], None] | None = None

    def arm(self, callback: Callable[[], None]) -> bool:
        cycle = self._cycle()
        if cycle is None or cycle.disconnected:
            return False
        self._callback = callback
        return True

    def disarm(self) -> None:
        self._callback = None

    def lost(self) -> None:
        callback, self._callback = self._callback, None
        if callback is not None:
            callback()


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol (its speed kept) with the limits httptools lacks: a head-size cap, a
    head deadline, a body backstop and a connection cap. Everything else is uvicorn's."""

    def __init__(self, config: uvicorn.Config, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        assert isinstance(config, ServerConfig)
        self._config = config
        self._limits = config.limits
        self._head_open = False  # a request head has begun and is not complete yet
        self._head_bytes = 0  # bytes of that head counted so far (see data_received)
        self._head_timer: TimerHandle | None = None
        self._body_timer: TimerHandle | None = None
        self._linger: TimerHandle | None = None
        self._done = False  # refused or cut off: ignore whatever else arrives
        self._draining = False  # the server is stopping: answer what arrives with `Connection: close`
        self._watch: ConnectionWatch | None = None  # the current request's, armed while it waits on the engine

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if len(self.connections) >= self._limits.max_connections:
            self._refuse(transport)
            return
        super().connection_made(transport)  # type: ignore[arg-type]  # uvicorn narrows it to asyncio.Transport
        self._start_head_timer()
        if self._config.draining:
            self.shutdown()

    def _refuse(self, transport: asyncio.BaseTransport) -> None:
        # Answered before reading anything: the whole point is to spend nothing on this client.
        self.transport = transport  # type: ignore[assignment]  # uvloop's transports are not asyncio.Transport subclasses
        self._limits.refusals.event()
        self._close(OverloadedError("The gateway has too many open connections; retry shortly.", retry_after=1.0))

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        super().connection_lost(exc)
        if self._watch is not None:
            self._watch.lost()

    def shutdown(self) -> None:
        """The server drains. uvicorn closes an idle keep-alive connection at once, which loses a request the
        client is sending at that moment (a POST it must not resend); here such a connection gets `_DRAIN_IDLE`
        seconds: a request that arrives is answered with `Connection: close`, silence closes it. Once per
        connection (a connection made after the stop signal is told in `connection_made`, and may be again by
        uvicorn)."""
        if self._draining:
            return
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
        self._watch = ConnectionWatch(self.cycle)
        self.scope[DISCONNECT_WATCH] = self._watch  # type: ignore[typeddict-unknown-key]  # our own scope key
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

    _wake: asyncio.Future[None] | None = None  # what `main_loop` waits on between two ticks
    _loop: asyncio.AbstractEventLoop | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler only records (the loop acts): flags read by the /ready route and by new connections.
        app: Any = self.config.app  # the FastAPI app `serve` built; uvicorn types it as any ASGI app
        app.state.readiness.draining = True
        if isinstance(self.config, ServerConfig):
            self.config.draining = True
        super().handle_exit(sig, frame)
        if self._loop is not None and self._wake is not None:
            # Through the loop's self-pipe: a signal handler may interrupt the loop itself, so it touches no future.
            self._loop.call_soon_threadsafe(_resolve, self._wake)

    async def main_loop(self) -> None:
        # uvicorn's own loop wakes ten times a second to see whether a stop signal came and refreshes the Date
        # header every tenth time: with 16 idle workers, that was most of the pool's idle CPU. Here the signal
        # wakes the loop itself (`handle_exit`), so the loop ticks once a second, for the Date header alone (its
        # resolution is a second). on_tick(0): uvicorn does its once-a-second work when the counter is 0 mod 10.
        self._loop = loop = asyncio.get_running_loop()
        if isinstance(self.config, ServerConfig) and self.config.freeze_heap:
            # Started: the modules, the app and its services live as long as the process. Left in the oldest
            # generation, every full collection walked them all (~100k objects, 80 ms, every ~1,400 requests at
            # c=32: `make bench`'s p99 was that pause). Startup's garbage is collected first, not kept for good.
            gc.collect()
            gc.freeze()
        while True:
            # Made before the check: a signal that comes after it resolves this future, one before it is seen.
            self._wake = wake = loop.create_future()
            if await self.on_tick(0):
                return
            timer = loop.call_later(_TICK, _resolve, wake)
            await wake
            timer.cancel()


def _resolve(wake: asyncio.Future[None]) -> None:
    if not wake.done():
        wake.set_result(None)


INTERNALS: tuple[LibraryInternals, ...] = (
    LibraryInternals(
        HttpToolsProtocol,
        subclass=GuardedHttpToolsProtocol,
        overridden=(
            "__init__",
            "connection_made",
            "connection_lost",
            "shutdown",
            "data_received",
            "on_message_begin",
            "on_headers_complete",
            "on_body",
            "on_message_complete",
        ),
        used=(
            "connections",
            "transport",
            "loop",
            "flow",
            "cycle",
            "pipeline",
            "parser",
            "url",
            "headers",
            "scope",
            "_unset_keepalive_if_required",
            "_should_upgrade",
            "handle_websocket_upgrade",
            "_unsupported_upgrade_warning",
        ),
    ),
    LibraryInternals(
        RequestResponseCycle,
        used=(
            "disconnected",
            "transport",
            "flow",
            "response_started",
            "response_complete",
            "chunked_encoding",
            "more_body",
            "keep_alive",
        ),
    ),
    LibraryInternals(FlowControl, used=("write_paused", "pause_reading")),
    LibraryInternals(
        uvicorn.Server,
        subclass=DrainingServer,
        overridden=("handle_exit", "main_loop"),
        used=("config", "on_tick", "started"),
    ),
    LibraryInternals(uvicorn.Config, subclass=ServerConfig, overridden=("__init__",), used=("app",)),
)
