"""The engine's HTTP/1.1 client: keep-alive connections whose answers httptools parses, in one bounded pool.

Why not aiohttp (the relay's client before): its request path (`ClientSession._request`: building a ClientRequest,
its auto headers and payload lookup, the connector's checkout, a ClientResponse and its StreamReader) was a fifth
of the gateway's CPU per non-stream request with keys and limits on (py-spy under the overhead benchmark), for a
peer that is always the one engine, on loopback, speaking HTTP/1.1. Here a request is one write of its head and
body on a pooled connection, and the answer is parsed in the connection's data callback by httptools (llhttp, the
parser uvicorn already runs for the gateway's own clients). The body chunks parsed from one read go on together, as
one piece, to the response's tap (the stream relay's straight path) or its buffer: a loaded engine's chunks arrive
several to a read, and each piece the tap takes is one write to the client (one system call, as nginx's one writev
for a read). A finished answer's connection goes back to the pool at once.

What it keeps of a client: a bound on connections (callers wait for one), idle connections dropped after
`keepalive_timeout` (below the engine's own idle timeout, so a request never goes out on a connection the engine
is closing), a connect timeout, reading paused while a response holds more than `HIGH_WATER` unread bytes, TLS for
an https engine. Failures are this module's exceptions (`ConnectFailedError`, `ConnectionLostError`,
`InvalidResponseError`) or TimeoutError; relay/client.py maps them to gateway errors. Imports `deadline` only.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Final, cast
from urllib.parse import urlsplit

import httptools

from gateway.deadline import deadline

# A tap sees the body bytes of each read from the engine in the connection's data callback and returns True when
# it relayed them itself.
Tap = Callable[[bytes], bool]
# Unread bytes a response buffers before the connection stops reading from the engine (TCP backpressure).
HIGH_WATER: Final = 2**16


class ClientError(Exception):
    """The engine could not be reached, or its answer was cut or malformed."""


class ConnectFailedError(ClientError):
    """No connection could be opened (nothing listens, the host is unreachable)."""


class ConnectionLostError(ClientError):
    """The connection ended before the answer did."""


class InvalidResponseError(ClientError):
    """The engine's bytes are not an HTTP/1.1 answer."""


class Response:
    """One answer: status and headers once `Pool.request` returns, the body read with `read_chunk` or `read_all`.

    Chunks that arrived before the connection failed are handed out before the failure is raised.
    """

    __slots__ = (
        "_chunks",
        "_connection",
        "_error",
        "_size",
        "_tap",
        "_waiter",
        "connected_at",
        "content_type",
        "done",
        "status",
    )

    def __init__(self, connection: _Connection) -> None:
        self._connection: _Connection | None = connection
        # When the request had its connection (pooled or new), on time.perf_counter()'s clock: the request's trace.
        self.connected_at = time.perf_counter()
        self.status = 0
        self.content_type: str | None = None  # the Content-Type header, when the answer has one
        self._chunks: list[bytes] = []
        self._size = 0
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._tap: Tap | None = None
        self.done = False  # the whole body arrived

    def tap(self, relay: Tap) -> None:
        """Offer the further body, a read's chunks at a time, to `relay` in the connection's data callback, before
        buffering it; what it returns True for is not buffered."""
        self._tap = relay

    async def read_chunk(self) -> bytes:
        """Every body byte buffered now, waiting for some if none are; b"" once the body is over."""
        while True:
            chunks = self._chunks
            if chunks:
                data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                self._chunks = []
                self._size = 0
                connection = self._connection
                if connection is not None and connection.paused:
                    connection.resume()
                return data
            if self._error is not None:
                raise self._error
            if self.done:
                return b""
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                if self._waiter is waiter:
                    self._waiter = None

    async def read_all(self) -> bytes:
        """The whole body."""
        parts = []
        while chunk := await self.read_chunk():
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def close(self) -> None:
        """Drop the connection unless the answer is complete (the engine sees the disconnect and stops generating)."""
        self._tap = None
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()

    # Called by the connection.

    def _feed(self, data: bytes) -> None:
        tap = self._tap
        if tap is not None and tap(data):
            return
        self._chunks.append(data)
        self._size += len(data)
        self._wake()
        connection = self._connection
        if self._size > HIGH_WATER and connection is not None and not connection.paused:
            connection.pause()

    def _finish(self) -> None:
        self.done = True
        self._connection = None
        self._wake()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._connection = None
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None  # the reader is woken: more data before it runs has nobody more to wake
            if not waiter.done():
                waiter.set_result(None)


class _Connection(asyncio.Protocol):
    """One keep-alive connection to the engine, carrying one request at a time; httptools calls its `on_*`."""

    def __init__(self, pool: Pool) -> None:
        self._pool = pool
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self._response: Response | None = None
        self._head: asyncio.Future[None] | None = None
        self._body: list[bytes] = []  # the body chunks parsed from the read being fed, handed on at its end
        self._length_known = False  # a Content-Length or chunked body: the connection's end does not end it
        self.paused = False
        self.lost = False
        self.idle_since = 0.0

    def send(self, request: bytes, response: Response) -> asyncio.Future[None]:
        """Write `request`; the future is done once `response` has its status and headers."""
        transport = self.transport
        if transport is None or self.lost or transport.is_closing():
            raise ConnectionLostError("the engine closed the connection")
        self._response = response
        self._length_known = False
        head = self._head = asyncio.get_running_loop().create_future()
        transport.write(request)
        return head

    def close(self) -> None:
        """Close the connection; an answer still arriving on it fails (the pool forgets it once it is gone)."""
        self._error(ConnectionLostError("the connection to the engine was closed before the answer was complete"))
        if self.transport is not None:
            self.transport.close()

    def pause(self) -> None:
        """Stop reading from the engine (a response holds too much unread)."""
        self.paused = True
        if self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()

    def resume(self) -> None:
        """Read from the engine again."""
        self.paused = False
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    # asyncio's protocol callbacks.

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio's subclasses
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if self._response is None:
            self.close()  # bytes nobody asked for: the connection cannot be trusted for the next request
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._error(InvalidResponseError(f"the engine's answer is not HTTP/1.1 ({exc})"))
            self.close()
            return
        if self._body:
            self._deliver()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        response, head = self._response, self._head
        if response is not None:
            if head is not None and head.done() and not self._length_known:
                self._response = None
                response._finish()  # a body without a length ends with the connection
            else:
                self._error(ConnectionLostError("the engine closed the connection before its answer was complete"))
        self._pool._forget(self)

    # httptools' callbacks.

    def on_header(self, name: bytes, value: bytes) -> None:
        response = self._response
        if response is not None:
            # The relay reads one header of the engine's answer; the others only say how its body ends.
            lowered = name.lower()
            if lowered == b"content-type":
                response.content_type = value.decode("latin-1")
            elif lowered == b"content-length" or lowered == b"transfer-encoding":
                self._length_known = True

    def on_headers_complete(self) -> None:
        response, head = self._response, self._head
        if response is not None and head is not None:
            response.status = self._parser.get_status_code()
            if not head.done():
                head.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self._response is not None:
            self._body.append(body)

    def on_message_complete(self) -> None:
        self._deliver()
        response, self._response = self._response, None
        if response is None:
            return
        response._finish()
        if self.paused:
            self.resume()
        if self._parser.should_keep_alive() and not self.lost:
            self._pool._release(self)
        else:
            self.close()

    def _deliver(self) -> None:
        """Hand the body chunks parsed so far from this read to the response, as one piece."""
        body, response = self._body, self._response
        if body:
            self._body = []
            if response is not None:
                response._feed(body[0] if len(body) == 1 else b"".join(body))

    def _error(self, error: ClientError) -> None:
        self._deliver()  # what arrived before the failure is handed out before it
        response, self._response = self._response, None
        head = self._head
        if head is not None and not head.done():
            head.set_exception(error)
        if response is not None:
            response._fail(error)


class Pool:
    """Keep-alive connections to one engine URL, at most `limit` open; `request` sends one request on one of them."""

    def __init__(self, url: str, *, limit: int, keepalive_timeout: float, connect_timeout: float) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self._prefix = parts.path.rstrip("/")
        self._host_line = f"Host: {parts.netloc}\r\n"
        self._limit = limit
        self._keepalive_timeout = keepalive_timeout
        self._connect_timeout = connect_timeout
        self._idle: list[_Connection] = []
        self._open: set[_Connection] = set()  # connected: counted against `limit`, with those connecting
        self._opening = 0
        self._waiters: deque[asyncio.Future[_Connection | None]] = deque()
        self._closed = False

    async def request(
        self, method: str, path: str, headers: Iterable[tuple[str, str]] = (), body: bytes = b""
    ) -> Response:
        """Send one request and wait for the answer's status and headers (the body is read from the Response).

        Raises ConnectFailedError, ConnectionLostError, InvalidResponseError, or TimeoutError (connecting).
        """
        head = [f"{method} {self._prefix}{path} HTTP/1.1\r\n", self._host_line, f"Content-Length: {len(body)}\r\n"]
        for name, value in headers:
            if "\r" in value or "\n" in value or "\r" in name or "\n" in name or ":" in name:
                raise ValueError(f"header {name!r} cannot be sent")
            head.append(f"{name}: {value}\r\n")
        head.append("\r\n")
        request = "".join(head).encode("latin-1") + body
        connection = await self._connection()
        response = Response(connection)
        try:
            await connection.send(request, response)
        except BaseException:
            response.close()
            raise
        return response

    async def close(self) -> None:
        """Close every connection; requests in flight fail with ConnectionLostError."""
        self._closed = True
        for connection in list(self._open):
            connection.close()
        self._idle.clear()
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(ConnectFailedError("the engine client is closed"))
        # Give the transports their turn to close (as aiohttp's session close does).
        await asyncio.sleep(0)

    async def _connection(self) -> _Connection:
        if self._closed:
            raise ConnectFailedError("the engine client is closed")
        idle = self._idle
        if idle:
            now = asyncio.get_running_loop().time()
            while idle:
                connection = idle.pop()
                if not connection.lost and now - connection.idle_since < self._keepalive_timeout:
                    return connection
                connection.close()
        while len(self._open) + self._opening >= self._limit:
            waiter: asyncio.Future[_Connection | None] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                handed = await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                    given = waiter.result()
                    if given is not None:
                        self._release(given)
                    else:
                        self._wake_one()
                raise
            if handed is not None and not handed.lost:
                return handed  # else it closed on its way here, and its place in the bound is free
        return await self._connect()

    async def _connect(self) -> _Connection:
        self._opening += 1
        connection = _Connection(self)
        try:
            async with deadline(self._connect_timeout):
                await asyncio.get_running_loop().create_connection(
                    lambda: connection, self._host, self._port, ssl=self._ssl
                )
        except OSError as exc:
            raise ConnectFailedError(f"cannot connect to the engine ({exc})") from None
        finally:
            self._opening -= 1
        if connection.lost:  # gone before it could be used
            raise ConnectionLostError("the engine closed the connection as it opened")
        self._open.add(connection)
        if self._closed:
            connection.close()
            raise ConnectFailedError("the engine client is closed")
        return connection

    def _release(self, connection: _Connection) -> None:
        """A connection whose answer is complete: to the first waiter, else idle."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(connection)
                return
        connection.idle_since = asyncio.get_running_loop().time()
        self._idle.append(connection)

    def _forget(self, connection: _Connection) -> None:
        """A connection is gone: its place in the bound goes to a waiter."""
        if connection in self._open:
            self._open.discard(connection)
            if connection in self._idle:
                self._idle.remove(connection)
            self._wake_one()

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
