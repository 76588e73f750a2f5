"""The engine client's connections and pool (relay/http1.py) against a raw asyncio server on 127.0.0.1: keep-alive
reuse, the bound on connections, idle expiry, chunked and length-less bodies, the tap, backpressure, and every way
an answer can fail."""

from __future__ import annotations

import asyncio
import ssl
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from gateway.relay import http1

pytestmark = pytest.mark.timeout(10)

Handler = Callable[[bytes, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[bool]]


class Engine:
    """A server that reads each request (head and Content-Length body) and lets `handler` answer it; the handler
    returns False to close the connection. Counts connections and requests."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed = asyncio.Event()
        self._server: asyncio.Server | None = None

    async def start(self, tls: ssl.SSLContext | None = None) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=tls)
        port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                request = head + await reader.readexactly(length)
                self.requests.append(request)
                if not await self.handler(request, reader, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            self.closed.set()


def answer(body: bytes, status: str = "200 OK", extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 " + status.encode() + b"\r\nContent-Length: %d\r\n" % len(body) + extra + b"\r\n" + body


async def ok(request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    writer.write(answer(b'{"ok":true}', extra=b"Content-Type: application/json\r\n"))
    await writer.drain()
    return True


@pytest.fixture
async def serve() -> AsyncIterator[Callable[..., Awaitable[tuple[Engine, http1.Pool]]]]:
    made: list[tuple[Engine, http1.Pool]] = []

    async def start(handler: Handler, **pool: float) -> tuple[Engine, http1.Pool]:
        engine = Engine(handler)
        url = await engine.start()
        settings = {"limit": 8, "keepalive_timeout": 5.0, "connect_timeout": 1.0, **pool}
        client = http1.Pool(
            url,
            limit=int(settings["limit"]),
            keepalive_timeout=settings["keepalive_timeout"],
            connect_timeout=settings["connect_timeout"],
        )
        made.append((engine, client))
        return engine, client

    yield start
    for engine, client in made:
        await client.close()
        await engine.stop()


async def test_an_answer_is_read_and_its_connection_carries_the_next_request(serve: Callable[..., Awaitable]) -> None:
    engine, pool = await serve(ok)
    for n in range(3):
        response = await pool.request("POST", "/v1/x", [("X-Request-Id", f"r{n}")], b'{"a":1}')
        assert response.status == 200
        assert response.content_type == "application/json"
        assert await response.read_all() == b'{"ok":true}'
    assert engine.connections == 1
    first = engine.requests[0]
    assert first.startswith(b"POST /v1/x HTTP/1.1\r\n") and b"\r\nX-Request-Id: r0\r\n" in first
    assert first.endswith(b'\r\n\r\n{"a":1}') and b"Content-Length: 7\r\n" in first


async def test_a_path_prefix_of_the_url_goes_before_every_path(serve: Callable[..., Awaitable]) -> None:
    engine = Engine(ok)
    url = await engine.start()
    pool = http1.Pool(url + "/engine/", limit=1, keepalive_timeout=5.0, connect_timeout=1.0)
    try:
        await (await pool.request("GET", "/health")).read_all()
        assert engine.requests[0].startswith(b"GET /engine/health HTTP/1.1\r\n")
    finally:
        await pool.close()
        await engine.stop()


async def test_a_chunked_body_arrives_a_read_at_a_time_and_the_tap_takes_what_it_relays(
    serve: Callable[..., Awaitable],
) -> None:
    release, more = asyncio.Event(), asyncio.Event()

    async def chunked(request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await release.wait()
        writer.write(b"6\r\nsecond\r\n5\r\nthird\r\n")  # two chunks in one write: one read
        await writer.drain()
        await more.wait()
        writer.write(b"4\r\nlast\r\n0\r\n\r\n")
        return True

    engine, pool = await serve(chunked)
    response = await pool.request("POST", "/stream")
    assert await response.read_chunk() == b"first"
    tapped: list[bytes] = []
    response.tap(lambda piece: piece.startswith(b"second") and not tapped.append(piece))
    release.set()
    for _ in range(200):  # until the read arrives (bounded: 2 s)
        if tapped:
            break
        await asyncio.sleep(0.01)
    assert tapped == [b"secondthird"], "the chunks of one read reach the tap as one piece"
    more.set()
    assert await response.read_chunk() == b"last"  # refused by the tap: buffered; what it took is not
    assert await response.read_chunk() == b""
    assert response.done
    await (await pool.request("POST", "/again")).read_chunk()
    assert engine.connections == 1


async def test_a_body_without_a_length_ends_with_the_connection(serve: Callable[..., Awaitable]) -> None:
    async def until_close(request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it")
        return False

    engine, pool = await serve(until_close)
    response = await pool.request("GET", "/metrics")
    assert await response.read_all() == b"all of it"
    await (await pool.request("GET", "/metrics")).read_all()
    assert engine.connections == 2, "a connection the engine closes is not reused"


async def test_the_pool_holds_at_most_limit_connections_and_the_rest_wait(serve: Callable[..., Awaitable]) -> None:
    gate = asyncio.Event()

    async def slow(request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        await gate.wait()
        return await ok(request, reader, writer)

    engine, pool = await serve(slow, limit=2)
    requests = [asyncio.ensure_future(pool.request("POST", f"/{n}")) for n in range(5)]
    for _ in range(200):  # until the first two arrive (bounded: 2 s)
        if len(engine.requests) == 2:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)  # time for a third to arrive, were the bound not kept
    assert engine.connections == 2 and len(engine.requests) == 2
    assert not any(r.done() for r in requests)
    gate.set()
    bodies = [await (await r).read_all() for r in requests]
    assert bodies == [b'{"ok":true}'] * 5
    assert engine.connections == 2


async def test_an_idle_connection_is_not_used_after_the_keepalive_timeout(serve: Callable[..., Awaitable]) -> None:
    engine, pool = await serve(ok, keepalive_timeout=0.1)
    await (await pool.request("GET", "/a")).read_all()
    await asyncio.sleep(0.2)
    await (await pool.request("GET", "/b")).read_all()
    assert engine.connections == 2
    await asyncio.wait_for(engine.closed.wait(), 1.0)  # the expired one was closed, not left open


async def test_an_idle_connection_the_engine_closed_is_replaced_without_an_error(
    serve: Callable[..., Awaitable],
) -> None:
    async def once(request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        await ok(request, reader, writer)
        return False  # the engine closes the connection after each answer, as at its idle timeout

    engine, pool = await serve(once)
    await (await pool.request("GET", "/a")).read_all()
    await asyncio.wait_for(engine.closed.wait(), 1.0)
    await asyncio.sleep(0.05)
    assert await (await pool.request("GET", "/b")).read_all() == b'{"ok":true}'
    assert engine.connections == 2


async def test_nothing_listening_is_connect_failed() -> None:
    probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = probe.sockets[0].getsockname()[1]
    probe.close()
    await probe.wait_closed()
    pool = http1.Pool(f"http://127.0.0.1:{port}", limit=1, keepalive_timeout=5.0, connect_timeout=1.0)
    with pytest.raises(http1.ConnectFailedError):
        await pool.request("GET", "/health")
    with pytest.raises(http1.ConnectFailedError):  # the failed attempt gave its place in the bound back
        await pool.request("GET", "/health")
    await pool.close()


async def test_a_body_cut_short_hands_out_what_arrived_then_fails(serve: Callable[..., Awaitable]) -> None:
    async def cut(request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort")
        await writer.drain()
        return False

    _engine, pool = await serve(cut)
    response = await pool.request("POST", "/x")
    assert await response.read_chunk() == b"short"
    with pytest.raises(http1.ConnectionLostError):
        await response.read_chunk()
    response = await pool.request("POST", "/x")
    with pytest.raises(http1.ConnectionLostError):
        await response.read_all()


async def test_a_connection_closed_before_the_head_is_connection_lost(serve: Callable[..., Awaitable]) -> None:
    async def hang_up(request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        return False

    _engine, pool = await serve(hang_up)
    with pytest.raises(http1.ConnectionLostError):
        await pool.request("POST", "/x")


async def test_bytes_that_are_not_http_are_an_invalid_response(serve: Callable[..., Awaitable]) -> None:
    async def garbage(request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"SSH-2.0-OpenSSH_9.2\r\n\r\n")
        await writer.drain()
        await reader.read()
        return False

    _engine, pool = await serve(garbage)
    with pytest.raises(http1.InvalidResponseError):
        await pool.request("POST", "/x")


async def test_a_response_holding_too_much_unread_pauses_reading_until_it_is_read(
    serve: Callable[..., Awaitable],
) -> None:
    size = 8 * http1.HIGH_WATER

    async def big(request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
        for _ in range(size // 1024):
            writer.write(b"x" * 1024)
            await writer.drain()
        return True

    engine, pool = await serve(big)
    response = await pool.request("GET", "/big")
    connection = response._connection
    assert connection is not None
    for _ in range(100):
        if connection.paused:
            break
        await asyncio.sleep(0.01)
    assert connection.paused, "nobody reads: the connection stops taking the engine's bytes"
    assert response._size < size
    assert len(await response.read_all()) == size
    assert not connection.paused
    assert len(await (await pool.request("GET", "/big")).read_all()) == size
    assert engine.connections == 1


async def test_a_request_cancelled_before_its_answer_drops_its_connection_and_frees_its_place(
    serve: Callable[..., Awaitable],
) -> None:
    async def late(request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        if len(engine.requests) == 1:
            await reader.read()  # no answer; until the client hangs up
            return False
        return await ok(request, reader, writer)

    engine, pool = await serve(late, limit=1)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(pool.request("POST", "/slow"), 0.1)
    await asyncio.wait_for(engine.closed.wait(), 1.0)  # the engine saw the disconnect
    assert await (await pool.request("POST", "/next")).read_all() == b'{"ok":true}'
    assert engine.connections == 2


async def test_closing_an_unfinished_response_drops_the_connection(serve: Callable[..., Awaitable]) -> None:
    async def endless(request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        while True:
            writer.write(b"1\r\nx\r\n")
            await writer.drain()
            await asyncio.sleep(0.01)

    engine, pool = await serve(endless)
    response = await pool.request("POST", "/stream")
    assert await response.read_chunk()
    response.close()
    await asyncio.wait_for(engine.closed.wait(), 1.0)


async def test_closing_the_pool_fails_an_answer_in_flight(serve: Callable[..., Awaitable]) -> None:
    async def partial(request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        await reader.read()
        return False

    _engine, pool = await serve(partial)
    response = await pool.request("POST", "/x")
    assert await response.read_chunk() == b"abc"
    reading = asyncio.ensure_future(response.read_chunk())
    await asyncio.sleep(0.01)
    await pool.close()
    with pytest.raises(http1.ConnectionLostError):
        await reading
    with pytest.raises(http1.ConnectFailedError):
        await pool.request("POST", "/x")


async def test_a_header_that_would_split_the_request_is_refused(serve: Callable[..., Awaitable]) -> None:
    engine, pool = await serve(ok)
    for name, value in (("X-Id", "a\r\nEvil: 1"), ("X-Id", "a\nb"), ("Evil: 1\r\nX", "a"), ("X:Y", "a")):
        with pytest.raises(ValueError):
            await pool.request("POST", "/x", [(name, value)])
    assert engine.connections == 0


def test_only_http_urls_make_a_pool() -> None:
    with pytest.raises(ValueError):
        http1.Pool("ftp://127.0.0.1:8000", limit=1, keepalive_timeout=1.0, connect_timeout=1.0)


@pytest.fixture
def self_signed(tmp_path: Path) -> tuple[Path, Path]:
    """A key and a self-signed certificate for `localhost`, made by the openssl command."""
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subject = ["-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost"]
    files = ["-keyout", str(key), "-out", str(cert)]
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", *subject, *files],
        check=True,
        capture_output=True,
    )
    return key, cert


async def test_an_https_engine_is_reached_over_tls_and_an_untrusted_one_is_refused(
    self_signed: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    key, cert = self_signed
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    engine = Engine(ok)
    port = (await engine.start(tls)).rsplit(":", 1)[1]
    try:
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # the engine's certificate is the one trusted
        pool = http1.Pool(f"https://localhost:{port}", limit=1, keepalive_timeout=5.0, connect_timeout=5.0)
        for _ in range(2):
            assert await (await pool.request("GET", "/health")).read_all() == b'{"ok":true}'
        await pool.close()
        assert engine.connections == 1 and engine.requests[0].startswith(b"GET /health HTTP/1.1\r\n")
        monkeypatch.delenv("SSL_CERT_FILE")
        untrusting = http1.Pool(f"https://localhost:{port}", limit=1, keepalive_timeout=5.0, connect_timeout=5.0)
        with pytest.raises(http1.ConnectFailedError, match="certificate"):
            await untrusting.request("GET", "/health")
        await untrusting.close()
    finally:
        await engine.stop()
