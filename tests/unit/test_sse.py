"""SSERelay driven as raw ASGI against a fake engine response (no sockets)."""

from __future__ import annotations

import ast
import asyncio
from collections.abc import Iterable
from pathlib import Path
from typing import Any, cast

import orjson
import pytest

from gateway.metrics.instruments import GatewayMetrics
from gateway.relay import http1
from gateway.relay import sse as sse_module
from gateway.relay.activity import EngineActivity
from gateway.relay.client import UpstreamResponse
from gateway.relay.shapes import CHAT, MESSAGES, RESPONSES, WireShape
from gateway.relay.sse import KEEP_ALIVE, SSERelay
from gateway.request_record import EngineErrorKind, RequestRecord
from gateway.settings import RelaySettings
from gateway.types import Message
from tests.clock import virtual_time

pytestmark = pytest.mark.timeout(5)

USAGE = {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14}


def event(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else orjson.dumps(payload).decode()
    return f"data: {data}\n\n".encode()


def delta(text: str, **extra: Any) -> bytes:
    return event(
        {"id": "c1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text}}], **extra}
    )


USAGE_EVENT = event({"id": "c1", "object": "chat.completion.chunk", "choices": [], "usage": USAGE})
DONE = b"data: [DONE]\n\n"


class FakeContent:
    """The engine's body: `readany()` hands out queued chunks (b"" is EOF) or raises a queued error."""

    def __init__(self, items: Iterable[bytes | BaseException] = (), on_read: Any = None) -> None:
        self.queue: asyncio.Queue[bytes | BaseException] = asyncio.Queue()
        for item in items:
            self.queue.put_nowait(item)
        self.on_read = on_read

    def feed(self, item: bytes | BaseException) -> None:
        self.queue.put_nowait(item)

    async def readany(self) -> bytes:
        if self.on_read is not None:
            self.on_read()
        # Queue.get is cancellation-safe, like http1.Response.read_chunk under the relay's timeouts.
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item


class FakeResponse:
    """Stands in for the engine client's Response (relay/http1.py) under a real UpstreamResponse (so its error
    mapping runs)."""

    def __init__(self, content: FakeContent, status: int = 200) -> None:
        self.status = status
        self.content = content
        self.content_type: str | None = None
        self.connected_at = 0.0
        self.close_calls = 0

    async def read_chunk(self) -> bytes:
        return await self.content.readany()

    def tap(self, relay: Any) -> None:
        raise AssertionError("no BodyWriter in these scopes: the relay must not tap")

    def close(self) -> None:
        self.close_calls += 1


class Client:
    """The ASGI side: a receive that only answers once `disconnect` is set, a send that collects."""

    def __init__(self) -> None:
        self.disconnect = asyncio.Event()
        self.messages: list[Message] = []
        self.sent = asyncio.Event()

    async def receive(self) -> Message:
        await self.disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        self.messages.append(message)
        self.sent.set()

    @property
    def bodies(self) -> list[Message]:
        return [m for m in self.messages if m["type"] == "http.response.body"]

    @property
    def body(self) -> bytes:
        return b"".join(m["body"] for m in self.bodies)


class Harness:
    def __init__(
        self,
        items: Iterable[bytes | BaseException] = (),
        *,
        strip_usage: bool = True,
        shape: WireShape = CHAT,
        settlement: Any = None,
        **relay: Any,
    ) -> None:
        self.client = Client()
        self.content = FakeContent(items)
        self.upstream = FakeResponse(self.content)
        self.record = RequestRecord(request_id="req-1", started_at=0.0)
        self.metrics = GatewayMetrics()
        self.activity = EngineActivity()
        settings = RelaySettings(**{"heartbeat_interval": 5.0, "chunk_timeout": 5.0, **relay})
        self.relay = SSERelay(
            UpstreamResponse(cast(http1.Response, self.upstream)),
            self.record,
            settings,
            self.metrics,
            strip_usage=strip_usage,
            shape=shape,
            settlement=settlement,
            activity=self.activity,
        )

    async def run(self) -> None:
        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions"}
        await self.relay(scope, self.client.receive, self.client.send)

    def sample(self, name: str, labels: dict[str, str]) -> float | None:
        return self.metrics.registry.get_sample_value(name, labels)


def error_of(message: Message) -> dict[str, Any]:
    body: bytes = message["body"]
    assert body.startswith(b"data: ") and body.endswith(b"\n\n"), body
    envelope = orjson.loads(body[len(b"data: ") :])
    assert set(envelope) == {"error"}
    assert set(envelope["error"]) == {"message", "type", "param", "code"}
    error: dict[str, Any] = envelope["error"]
    return error


async def test_normal_stream_is_relayed_byte_for_byte_and_in_order() -> None:
    chunks = [b": engine comment\n\n", delta("Hel"), delta("lo") + delta(" wor"), delta("ld"), DONE, b""]
    h = Harness(chunks, strip_usage=False)
    await h.run()
    start = h.client.messages[0]
    assert start["type"] == "http.response.start"
    assert start["status"] == 200
    headers = dict(start["headers"])
    assert headers[b"content-type"].startswith(b"text/event-stream")
    assert headers[b"x-accel-buffering"] == b"no"
    assert h.client.body == b"".join(chunks)
    assert [m["more_body"] for m in h.client.bodies] == [True] * 5 + [False]
    assert h.upstream.close_calls == 1
    assert h.record.engine_error is None


async def test_each_whole_line_chunk_is_sent_before_the_next_read() -> None:
    chunks = [delta("a"), delta("b"), delta("c"), DONE]
    sent_at_read: list[int] = []
    h = Harness([*chunks, b""])
    h.content.on_read = lambda: sent_at_read.append(len(h.client.bodies))
    await h.run()
    # Read i happens after exactly i body messages: nothing is held back waiting for more data.
    assert sent_at_read == [0, 1, 2, 3, 4]
    assert [m["body"] for m in h.client.bodies[:4]] == chunks


@pytest.mark.parametrize("strip_usage", [True, False])
async def test_usage_only_chunk_is_stripped_only_when_asked_and_always_recorded(strip_usage: bool) -> None:
    stream = [delta("hi"), delta("!", usage=None), USAGE_EVENT, DONE]
    h = Harness([*stream, b""], strip_usage=strip_usage)
    await h.run()
    expected = b"".join(stream) if not strip_usage else b"".join(c for c in stream if c is not USAGE_EVENT)
    assert h.client.body == expected
    assert (h.record.prompt_tokens, h.record.completion_tokens) == (11, 3)


async def test_usage_event_in_the_same_read_as_others_is_cut_out_exactly() -> None:
    h = Harness([delta("hi") + USAGE_EVENT + DONE, b""], strip_usage=True)
    await h.run()
    assert h.client.body == delta("hi") + DONE
    assert h.record.completion_tokens == 3


async def test_usage_line_split_across_reads_is_held_back_then_handled_whole() -> None:
    cut = USAGE_EVENT.index(b"prompt_tokens") + 4
    first, second = delta("x") + USAGE_EVENT[:cut], USAGE_EVENT[cut:] + DONE
    sent_at_read: list[bytes] = []
    h = Harness([first, second, b""], strip_usage=True)
    h.content.on_read = lambda: sent_at_read.append(h.client.body)
    await h.run()
    # After the first read only the complete event went out; the partial usage line waited.
    assert sent_at_read[1] == delta("x")
    assert h.client.body == delta("x") + DONE
    assert (h.record.prompt_tokens, h.record.completion_tokens) == (11, 3)


async def test_usage_split_kept_for_a_client_that_asked_for_it() -> None:
    cut = len(USAGE_EVENT) // 2
    h = Harness([USAGE_EVENT[:cut], USAGE_EVENT[cut:], DONE, b""], strip_usage=False)
    await h.run()
    assert h.client.body == USAGE_EVENT + DONE
    assert h.record.total_tokens == 14


async def test_usage_only_event_is_stripped_when_earlier_events_in_the_read_carry_usage() -> None:
    # With stream_options.continuous_usage_stats every chunk carries usage; the engine's last content
    # chunk and its usage-only chunk often arrive in one read.
    running = {"prompt_tokens": 11, "completion_tokens": 2, "total_tokens": 13}
    last = delta("!", usage=running)
    h = Harness([last + USAGE_EVENT + DONE, b""], strip_usage=True)
    await h.run()
    assert h.client.body == last + DONE
    assert h.record.completion_tokens == 3


async def test_stream_without_done_ends_with_one_error_event() -> None:
    h = Harness([delta("partial"), b""])
    await h.run()
    bodies = h.client.bodies
    assert bodies[0]["body"] == delta("partial")
    assert len(bodies) == 2
    assert bodies[-1]["more_body"] is False
    error = error_of(bodies[-1])
    assert error["code"] == "engine_unavailable"
    assert "incomplete" in error["message"]
    assert h.record.engine_error is EngineErrorKind.MID_STREAM


async def test_payload_error_mid_stream_ends_with_error_event_and_closes_upstream() -> None:
    h = Harness([delta("a"), http1.ConnectionLostError("connection reset")])
    await h.run()
    bodies = h.client.bodies
    assert [m["body"] for m in bodies[:-1]] == [delta("a")]
    assert bodies[-1]["more_body"] is False
    error = error_of(bodies[-1])
    assert error["code"] == "engine_unavailable"
    assert error["type"] == "service_unavailable"
    assert h.upstream.close_calls == 1
    assert h.record.engine_error is EngineErrorKind.MID_STREAM


async def test_heartbeat_fills_silence_before_the_first_data() -> None:
    h = Harness(heartbeat_interval=0.05, chunk_timeout=0.5)

    async def engine() -> None:
        await asyncio.sleep(0.2)
        h.content.feed(delta("late") + DONE)
        h.content.feed(b"")

    feeder = asyncio.create_task(engine())
    await h.run()
    await feeder
    bodies = [m["body"] for m in h.client.bodies]
    first_data = bodies.index(delta("late") + DONE)
    assert first_data >= 1
    assert set(bodies[:first_data]) == {KEEP_ALIVE}
    assert KEEP_ALIVE == b": keep-alive\n\n"
    assert h.client.bodies[-1]["more_body"] is False
    assert h.record.engine_error is None


@virtual_time
async def test_silent_engine_is_cut_at_chunk_timeout_with_engine_timeout_event() -> None:
    h = Harness([delta("a")], heartbeat_interval=0.05, chunk_timeout=0.2)
    loop = asyncio.get_running_loop()
    started = loop.time()
    await h.run()
    assert loop.time() - started == pytest.approx(0.2)  # the loop's virtual clock: at the chunk timeout exactly
    bodies = h.client.bodies
    assert bodies[0]["body"] == delta("a")
    assert KEEP_ALIVE in [m["body"] for m in bodies[1:-1]]
    assert bodies[-1]["more_body"] is False
    error = error_of(bodies[-1])
    assert error["code"] == "engine_timeout"
    assert error["type"] == "service_unavailable"
    assert h.record.engine_error is EngineErrorKind.TIMEOUT
    assert h.upstream.close_calls == 1


@pytest.mark.parametrize(
    "error",
    [http1.ConnectionLostError("closed"), http1.InvalidResponseError("not HTTP/1.1"), TimeoutError()],
)
async def test_any_engine_error_mid_stream_is_one_mid_stream_event(error: BaseException) -> None:
    h = Harness([delta("a"), error])
    await h.run()
    assert error_of(h.client.bodies[-1])["code"] == "engine_unavailable"
    assert h.record.engine_error is EngineErrorKind.MID_STREAM


async def test_every_chunk_is_engine_progress_and_the_stream_is_in_flight_until_it_ends() -> None:
    h = Harness()
    h.activity.last_progress = 0.0
    task = asyncio.create_task(h.run())
    await h.client.sent.wait()  # the start message
    assert h.activity.in_flight == 1
    assert h.activity.last_progress == 0.0, "headers alone are no proof that the engine generates"
    h.client.sent.clear()
    h.content.feed(delta("a"))
    await h.client.sent.wait()
    assert h.activity.last_progress > 0.0
    h.content.feed(DONE)
    h.content.feed(b"")
    await asyncio.wait_for(task, 1.0)
    assert h.activity.in_flight == 0


async def test_a_stuck_engine_ends_the_stream_with_one_error_event_at_once() -> None:
    h = Harness([delta("a")], heartbeat_interval=5.0, chunk_timeout=5.0)
    task = asyncio.create_task(h.run())
    await h.client.sent.wait()
    h.client.sent.clear()
    await h.client.sent.wait()  # the first body; the relay now waits on the engine
    assert h.activity.abort_all() == 1  # what the engine monitor does when it finds the engine stuck
    await asyncio.wait_for(task, 1.0)
    bodies = h.client.bodies
    assert [m["body"] for m in bodies[:-1]] == [delta("a")]
    error = error_of(bodies[-1])
    assert error["code"] == "engine_unavailable" and "stopped generating" in error["message"]
    assert h.record.engine_error is EngineErrorKind.FROZEN
    assert h.upstream.close_calls == 1


async def test_client_disconnect_closes_upstream_and_is_recorded() -> None:
    h = Harness([delta("a")])
    task = asyncio.create_task(h.run())
    await h.client.sent.wait()  # the start message
    h.client.sent.clear()
    await h.client.sent.wait()  # the first body
    assert [m["body"] for m in h.client.bodies] == [delta("a")]
    assert h.upstream.close_calls == 0
    h.client.disconnect.set()
    await asyncio.wait_for(task, 1.0)
    assert h.upstream.close_calls == 1
    assert h.record.client_disconnected is True
    assert h.sample("nemotron_gateway_client_disconnects_total", {"mode": "stream"}) == 1.0
    # Nothing is written to a client that has gone.
    assert [m["body"] for m in h.client.bodies] == [delta("a")]


def test_the_stream_relay_reads_through_the_client_and_never_imports_its_connections() -> None:
    # The engine client's errors are mapped once, in relay/client.py; the relay only sees gateway errors.
    source = Path(sse_module.__file__).read_text()
    imported: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.update(f"{node.module}.{alias.name}" for alias in node.names)
    assert "gateway.relay.client.UpstreamResponse" in imported
    assert not [name for name in imported if name.startswith(("gateway.relay.http1", "httptools", "aiohttp"))]


async def test_a_stream_the_server_cancels_ends_with_an_error_event() -> None:
    # uvicorn cancels a response once its shutdown grace is over: the client must see why the answer stops.
    h = Harness([delta("a")])
    task = asyncio.ensure_future(h.run())
    await h.client.sent.wait()
    while len(h.client.bodies) < 1:
        h.client.sent.clear()
        await h.client.sent.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    last = h.client.bodies[-1]
    assert last["more_body"] is False
    assert error_of(last)["type"] == "service_unavailable"
    assert b"[DONE]" not in h.client.body
    assert h.upstream.close_calls == 1


_COMPLETED = (
    b'event: response.completed\ndata: {"type":"response.completed","sequence_number":3,"response":{"id":"resp_1",'
    b'"object":"response","status":"completed","usage":{"input_tokens":4,"output_tokens":6,'
    b'"output_tokens_details":{"reasoning_tokens":2}}}}\n\n'
)


async def test_a_responses_stream_ends_at_its_completed_event_split_anywhere_and_its_usage_is_taken() -> None:
    created = b'event: response.created\ndata: {"type":"response.created","response":{"usage":null}}\n\n'
    cut = _COMPLETED.index(b"usage") + 3
    harness = Harness([created, _COMPLETED[:20], _COMPLETED[20:cut], _COMPLETED[cut:], b""], shape=RESPONSES)
    await harness.run()
    assert harness.client.body == created + _COMPLETED
    assert (harness.record.prompt_tokens, harness.record.completion_tokens, harness.record.reasoning_tokens) == (
        4,
        6,
        2,
    )
    assert harness.record.response_id == "resp_1" and harness.record.engine_error is None


async def test_a_messages_stream_cut_before_message_stop_ends_with_anthropics_error_event() -> None:
    start = b'event: message_start\ndata: {"type":"message_start","message":{"usage":{"input_tokens":3}}}\n\n'
    harness = Harness([start, b""], shape=MESSAGES)
    await harness.run()
    tail = harness.client.bodies[-1]["body"]
    assert tail.startswith(b"event: error\ndata: ")
    event = orjson.loads(tail.split(b"data: ", 1)[1])
    assert event["type"] == "error" and event["error"]["type"] == "overloaded_error"
    assert harness.record.engine_error is EngineErrorKind.MID_STREAM


def test_anthropic_usage_counts_cached_prompt_tokens_in_the_prompt() -> None:
    record = RequestRecord(request_id="r", started_at=0.0)
    record.take_usage({"input_tokens": 3, "output_tokens": 5, "cache_read_input_tokens": 10})
    assert (record.prompt_tokens, record.completion_tokens) == (13, 5)


class SettledAt:
    """A settlement that notes how much of the body the client had when the exchange was settled."""

    def __init__(self) -> None:
        self.client = Client()
        self.sent_before: list[bytes] = []

    async def settle(self) -> None:
        self.sent_before.append(self.client.body)


# What a client can put into the request's `metadata` and `tools`, which vLLM echoes in a Responses stream's first
# events: the terminal type, and usage objects of its own.
_PLANTED = {
    "metadata": {"type": "response.completed", "note": '"type":"response.completed"'},
    "tools": [{"type": "function", "name": "f", "parameters": {"usage": {"input_tokens": 0, "output_tokens": 0}}}],
}


def typed(payload: dict[str, Any]) -> bytes:
    """One event of a typed stream (Responses, Messages): its name line, then its data."""
    return b"event: %s\ndata: %s\n\n" % (payload["type"].encode(), orjson.dumps(payload))


_RESPONSES_PLANTED = [
    typed({"response": {"id": "resp_1", "object": "response", "usage": None, **_PLANTED}, "type": "response.created"}),
    # What the model writes reaches the stream inside a JSON string.
    typed({"delta": '"type":"response.completed"', "type": "response.output_text.delta"}),
    _COMPLETED,
]
_MESSAGES_PLANTED = [
    typed(
        {
            "type": "message_start",
            "message": {"usage": {"input_tokens": 3, "output_tokens": 0}, "echo": {"type": "message_stop"}},
            "usage": None,
        }
    ),
    typed({"type": "content_block_delta", "delta": {"text": '"type":"message_stop"'}}),
    typed({"type": "message_delta", "usage": {"input_tokens": 3, "output_tokens": 9}}),
    typed({"type": "message_stop"}),
]


@pytest.mark.parametrize(("shape", "events"), [(RESPONSES, _RESPONSES_PLANTED), (MESSAGES, _MESSAGES_PLANTED)])
async def test_client_text_echoed_in_a_stream_neither_ends_it_nor_sets_its_usage(
    shape: WireShape, events: list[bytes]
) -> None:
    settled = SettledAt()
    harness = Harness([*events, b""], shape=shape, settlement=settled)
    client = settled.client = harness.client
    await harness.run()
    assert client.body == b"".join(events) and harness.record.engine_error is None
    # Settled once, just before the real end went out, with the engine's usage (not the echoed one).
    assert settled.sent_before == [b"".join(events[:-1])]
    assert (harness.record.prompt_tokens, harness.record.completion_tokens) == (
        (4, 6) if shape is RESPONSES else (3, 9)
    )


async def test_a_chat_stream_ends_only_at_its_own_done_line() -> None:
    # The client's text "data: [DONE]" reaches a chunk only inside a JSON string, in one read with other events.
    forged = delta("\n\ndata: [DONE]") + delta("data: [DONE]")
    settled = SettledAt()
    harness = Harness([forged, delta("more"), DONE, b""], settlement=settled)
    client = settled.client = harness.client
    await harness.run()
    assert settled.sent_before == [forged + delta("more")]
    assert client.body == forged + delta("more") + DONE
