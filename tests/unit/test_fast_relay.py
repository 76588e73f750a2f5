"""The relay's fast path (a chunk costs no task wake-up and no trip through the middleware): plain content chunks
go from the engine connection's data callback straight to the client's connection through the server's
BodyWriter; everything the relay must look at still goes through ASGI's send, and the client receives every byte
in the engine's order either way. The engine client's real connection and response, parsing chunked HTTP/1.1
from a transport with no socket."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, cast

import orjson
import pytest

from gateway.metrics.instruments import GatewayMetrics
from gateway.relay import http1
from gateway.relay.client import UpstreamResponse
from gateway.relay.sse import BODY_WRITER, SSERelay
from gateway.request_record import RequestRecord
from gateway.settings import RelaySettings
from gateway.types import Message

pytestmark = pytest.mark.timeout(5)

USAGE = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
DONE = b"data: [DONE]\n\n"


def event(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def delta(text: str) -> bytes:
    return event({"id": "c1", "choices": [{"index": 0, "delta": {"content": text}}]})


USAGE_EVENT = event({"id": "c1", "choices": [], "usage": USAGE})


class _Transport:
    """The engine connection's transport, without a socket: what the request writes goes nowhere."""

    def write(self, data: bytes) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


class Client:
    """Both ways to the client, in one log: ("send", bytes) from ASGI send, ("direct", bytes) from the writer."""

    def __init__(self) -> None:
        self.log: list[tuple[str, bytes]] = []
        self.accept_direct = True

    async def receive(self) -> Message:
        await asyncio.Event().wait()  # the client never leaves
        raise AssertionError("unreachable")

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.body":
            self.log.append(("send", message["body"]))

    def write(self, body: bytes) -> bool:
        if not self.accept_direct:
            return False
        self.log.append(("direct", body))
        return True

    @property
    def body(self) -> bytes:
        return b"".join(data for _, data in self.log)

    def via(self, path: str) -> list[bytes]:
        return [data for way, data in self.log if way == path]


async def _until(condition: Callable[[], bool]) -> None:
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never met")


async def _relay() -> tuple[SSERelay, http1._Connection, http1.Response, RequestRecord]:
    pool = http1.Pool("http://127.0.0.1:9", limit=1, keepalive_timeout=1.0, connect_timeout=1.0)
    connection = http1._Connection(pool)
    connection.connection_made(cast(Any, _Transport()))
    response = http1.Response(connection)
    head = connection.send(b"POST /v1/chat/completions HTTP/1.1\r\n\r\n", response)
    connection.data_received(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
    await head
    record = RequestRecord(request_id="req-1", started_at=0.0)
    settings = RelaySettings(heartbeat_interval=5.0, chunk_timeout=5.0)
    relay = SSERelay(UpstreamResponse(response), record, settings, GatewayMetrics(), strip_usage=True)
    return relay, connection, response, record


async def _feed(connection: http1._Connection, response: http1.Response, chunks: list[bytes]) -> None:
    """Each chunk as one chunk of the engine's chunked body, once the relay waits on the engine for more."""
    for chunk in chunks:
        await _until(lambda: response._waiter is not None)
        connection.data_received(b"%x\r\n%b\r\n" % (len(chunk), chunk))
    await _until(lambda: response._waiter is not None)
    connection.data_received(b"0\r\n\r\n")


async def _run(client: Client, chunks: list[bytes], *, with_writer: bool = True) -> RequestRecord:
    relay, connection, response, record = await _relay()
    scope: dict[str, Any] = {"type": "http", "method": "POST", "path": "/v1/chat/completions"}
    if with_writer:
        scope[BODY_WRITER] = client
    task = asyncio.ensure_future(relay(scope, client.receive, client.send))
    await _feed(connection, response, chunks)
    await task
    return record


async def test_content_chunks_go_straight_to_the_client_and_the_rest_through_send() -> None:
    client = Client()
    contents = [delta("a"), delta("b"), delta("c")]
    record = await _run(client, [delta(""), *contents, USAGE_EVENT, DONE])
    # The first chunk (it times the first token), the usage chunk (read, then dropped: the client did not ask
    # for it) and [DONE] (the key's charge is settled before it) go through send; the content goes direct.
    assert client.via("direct") == contents
    assert client.via("send") == [delta(""), b"", DONE, b""]  # b"": the dropped usage chunk's place
    assert client.body == delta("") + b"".join(contents) + DONE
    assert record.total_tokens == 8


async def test_the_chunks_of_one_read_go_to_the_client_in_one_write() -> None:
    # A loaded engine's chunks arrive several to a read: one write (one system call) carries them all, as
    # nginx's one writev for a read does; what the relay must look at still goes through send.
    relay, connection, response, record = await _relay()
    client = Client()
    scope: dict[str, Any] = {"type": "http", BODY_WRITER: client}
    task = asyncio.ensure_future(relay(scope, client.receive, client.send))
    contents = [delta("a"), delta("b"), delta("c")]
    # One read each: the first chunk (it times the first token, through send), three content chunks, the end.
    for read in ([delta("")], contents, [USAGE_EVENT, DONE]):
        await _until(lambda: response._waiter is not None)
        connection.data_received(b"".join(b"%x\r\n%b\r\n" % (len(chunk), chunk) for chunk in read))
    connection.data_received(b"0\r\n\r\n")
    await task
    assert client.via("direct") == [b"".join(contents)]
    assert client.body == delta("") + b"".join(contents) + DONE
    assert record.total_tokens == 8


async def test_a_usage_in_any_spacing_is_read_and_a_null_usage_is_relayed_as_it_came() -> None:
    # The straight path holds back any chunk naming "usage": a usage object, compact or spaced, is read (and
    # dropped: the client did not ask for it); a content chunk with "usage": null reaches the client unchanged.
    client = Client()
    with_null = b'data: {"id": "c1", "choices": [{"index": 0, "delta": {"content": "a"}}], "usage": null}\n\n'
    spaced_usage = (
        b'data: {"id": "c1", "choices": [], '
        b'"usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}\n\n'
    )
    record = await _run(client, [delta(""), delta("b"), with_null, delta("c"), spaced_usage, DONE])
    assert client.body == delta("") + delta("b") + with_null + delta("c") + DONE
    assert with_null not in client.via("direct") and delta("b") in client.via("direct")
    assert record.total_tokens == 8


async def test_a_client_that_cannot_take_more_gets_the_same_bytes_through_send() -> None:
    client = Client()
    client.accept_direct = False  # e.g. its write buffer is full: send waits for it to drain
    chunks = [delta(""), delta("a"), delta("b"), DONE]
    await _run(client, chunks)
    assert client.via("direct") == []
    assert client.body == b"".join(chunks)


async def test_partial_lines_wait_for_their_end_and_keep_their_order() -> None:
    client = Client()
    first, second = delta("x"), delta("y")
    await _run(client, [delta(""), first[:10], first[10:] + second[:5], second[5:], delta("z"), DONE])
    assert client.body == delta("") + first + second + delta("z") + DONE
    # Nothing after a partial line may overtake it: the line's end and what follows take the pump's path.
    assert client.via("direct") == [delta("z")]


async def test_without_a_writer_every_chunk_goes_through_send() -> None:
    client = Client()
    chunks = [delta(""), delta("a"), DONE]
    await _run(client, chunks, with_writer=False)
    assert client.via("direct") == []
    assert client.body == b"".join(chunks)
