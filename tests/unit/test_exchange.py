"""EngineRelay against a tiny in-process engine (aiohttp.web): every failure counted once by kind, the
token charge kept or refunded as the engine may or may not have worked, a stuck engine's waiters ended."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from aiohttp import web

from gateway.errors import (
    EngineCredentialsError,
    EngineProtocolError,
    EngineRefusedError,
    EngineTimeoutError,
    EngineUnavailableError,
    RateLimitError,
)
from gateway.metrics.instruments import GatewayMetrics
from gateway.ratelimit.limiter import rate_limit_error
from gateway.relay.activity import EngineActivity
from gateway.relay.client import EngineClient
from gateway.relay.exchange import BufferedAnswer, EngineRelay, Exchange
from gateway.relay.monitor import EngineMonitor
from gateway.relay.sse import SSERelay
from gateway.request_record import EngineErrorKind, RequestRecord
from gateway.settings import Settings
from gateway.types import Message
from tests.procs import async_wait_until, free_port

pytestmark = pytest.mark.timeout(20)

USAGE = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}


async def _never_disconnects() -> Message:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


@dataclass
class Rig:
    relay: EngineRelay
    monitor: EngineMonitor
    activity: EngineActivity
    metrics: GatewayMetrics
    settled: list[int | None] = field(default_factory=list)
    served: list[bool] = field(default_factory=list)
    seen_ids: list[str] = field(default_factory=list)
    headers: dict[str, str] = field(default_factory=lambda: {"x-ratelimit-limit-requests": "10"})
    target: Any = None

    async def release(self, used: int | None, record: RequestRecord | None = None, *, served: bool = True) -> None:
        """The rate-limit lease's release, as the exchange calls it: the tokens it settles with are recorded, and
        whether the engine saw the request."""
        self.settled.append(used)
        self.served.append(served)

    async def forward(
        self, *, stream: bool = False, request_id: str = "client-id", admitting: asyncio.Task[None] | None = None
    ) -> Any:
        record = RequestRecord(request_id=request_id, started_at=0.0)
        self.record = record
        return await self.relay.forward(
            Exchange(
                "/v1/chat/completions",
                b'{"model": "m"}',
                record,
                _never_disconnects,
                stream=stream,
                strip_usage=True,
                target=self.target,
                lease=self,
                admitting=admitting,
            )
        )

    def errors(self) -> dict[str, float]:
        counts = {}
        for kind in EngineErrorKind:
            value = self.metrics.registry.get_sample_value(
                "nemotron_gateway_engine_errors_total", {"replica": self.target.url, "model": "nemotron", "kind": kind}
            )
            if value:
                counts[kind.value] = value
        return counts


Handler = Callable[[web.Request], Any]


class _Target:
    """The one engine as the exchange's replica."""

    def __init__(
        self, url: str, client: EngineClient, monitor: EngineMonitor, activity: EngineActivity, metrics: GatewayMetrics
    ) -> None:
        self.url, self.client, self.monitor, self.activity = url, client, monitor, activity
        self.errors = {kind: metrics.engine_errors.labels(url, "nemotron", kind.value) for kind in EngineErrorKind}


@pytest.fixture
async def make_rig() -> AsyncIterator[Callable[..., Any]]:
    cleanups: list[Callable[[], Any]] = []

    async def build(handler: Handler | None = None, **relay: Any) -> Rig:
        port = free_port()
        seen: list[str] = []
        if handler is None:
            # Bound, never listening: a connection is refused, and no other process can take the port meanwhile.
            closed = socket.socket()
            closed.bind(("127.0.0.1", port))

            async def release_port() -> None:
                closed.close()

            cleanups.append(release_port)
        else:

            async def recording(request: web.Request) -> Any:
                seen.append(request.headers.get("X-Request-Id", ""))
                return await handler(request)

            app = web.Application()
            app.router.add_post("/v1/chat/completions", recording)
            runner = web.AppRunner(app, shutdown_timeout=0.1, handler_cancellation=True)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            cleanups.append(runner.cleanup)
        settings = Settings(engine_url=f"http://127.0.0.1:{port}", relay={"first_byte_timeout": 0.5, **relay})
        metrics = GatewayMetrics()
        client = EngineClient(settings)
        await client.start()
        cleanups.append(client.stop)
        activity = EngineActivity()
        monitor = EngineMonitor(client, settings.relay, metrics, activity, state_dir=settings.engine.state_dir)
        rig = Rig(EngineRelay(settings.relay, metrics), monitor, activity, metrics)
        rig.target = _Target(settings.engine_url, client, monitor, activity, metrics)
        rig.seen_ids = seen
        return rig

    yield build
    for cleanup in reversed(cleanups):
        await cleanup()


async def test_answer_settles_with_the_reported_usage_and_counts_as_progress(make_rig: Any) -> None:
    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"choices": [], "usage": USAGE})

    rig = await make_rig(ok)
    rig.activity.last_progress = 0.0
    answer = await rig.forward()
    assert isinstance(answer, BufferedAnswer) and answer.status == 200
    assert (b"x-ratelimit-limit-requests", b"10") in answer.headers
    assert rig.settled == [7] and rig.served == [True]
    assert rig.errors() == {}
    assert rig.activity.last_progress > 0.0
    # The engine saw a request id of its own, derived from the client's.
    assert rig.seen_ids[0].startswith("client-id-") and rig.seen_ids[0] == rig.record.engine_request_id


async def test_refused_connection_refunds_counts_and_marks_down_with_one_message(make_rig: Any) -> None:
    rig = await make_rig(None)  # nothing listens
    with pytest.raises(EngineRefusedError):
        await rig.forward()
    assert rig.settled == [0]
    assert rig.served == [False], "the engine never saw it: the key's request is given back"
    assert rig.errors() == {"refused": 1.0}
    assert rig.monitor.ready_reason() == "connection refused"
    with pytest.raises(EngineUnavailableError) as caught:
        await rig.monitor.require_ready()
    assert caught.value.message == "The model engine is not ready (connection refused); retry shortly."


async def test_timeout_after_the_engine_took_the_request_keeps_the_charge(make_rig: Any) -> None:
    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(5)
        return web.json_response({})

    rig = await make_rig(slow)
    with pytest.raises(EngineTimeoutError):
        await rig.forward()
    assert rig.settled == [None], "the engine may have generated: the estimate stays charged"
    assert rig.errors() == {"timeout": 1.0}
    assert rig.monitor.ready_reason() != "connection refused", "a slow engine is not a dead one"


async def test_invalid_answer_is_a_counted_protocol_error(make_rig: Any) -> None:
    async def garbage(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(status=200, headers={"Content-Length": "100"})
        await response.prepare(request)
        await response.write(b"short")
        assert request.transport is not None
        request.transport.close()  # fewer bytes than announced
        return response

    rig = await make_rig(garbage)
    with pytest.raises((EngineProtocolError, EngineUnavailableError)):
        await rig.forward()
    assert sum(rig.errors().values()) == 1.0
    assert set(rig.errors()) <= {"protocol", "connection_lost"}
    assert rig.settled == [None]


async def test_error_answer_is_relayed_counted_and_refunded(make_rig: Any) -> None:
    async def bad(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "too long", "type": "BadRequestError"}}, status=400)

    for stream in (False, True):
        rig = await make_rig(bad)
        answer = await rig.forward(stream=stream)
        assert isinstance(answer, BufferedAnswer) and answer.status == 400
        assert orjson.loads(answer.body)["error"]["message"] == "too long"
        assert rig.settled == [0]
        assert rig.served == [True], "the engine answered it: a request of the key"
        assert rig.errors() == {"error_status": 1.0}


async def test_an_engine_refusing_the_gateways_key_is_a_502_never_the_clients_401(make_rig: Any) -> None:
    async def unauthorized(request: web.Request) -> web.Response:
        return web.json_response({"error": "Unauthorized"}, status=401)  # vLLM's answer to a wrong --api-key

    for stream in (False, True):
        rig = await make_rig(unauthorized)
        with pytest.raises(EngineCredentialsError) as caught:
            await rig.forward(stream=stream)
        assert caught.value.status_code == 502 and "NEMOTRON_ENGINE_API_KEY" in caught.value.message
        assert rig.settled == [0]
        assert rig.errors() == {"error_status": 1.0}


async def test_stream_cut_short_is_counted_once_and_keeps_the_charge(make_rig: Any) -> None:
    async def dies(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n')
        assert request.transport is not None
        request.transport.close()
        return response

    rig = await make_rig(dies)
    relay = await rig.forward(stream=True)
    assert isinstance(relay, SSERelay)
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    await relay({"type": "http"}, _never_disconnects, send)
    assert b"incomplete" in sent[-1]["body"]
    assert rig.errors() == {"mid_stream": 1.0}
    assert rig.settled == [None]


async def test_a_stuck_engine_ends_a_waiting_request_with_a_503(make_rig: Any) -> None:
    started = asyncio.Event()

    async def frozen(request: web.Request) -> web.Response:
        started.set()
        await asyncio.sleep(30)
        return web.json_response({})

    rig = await make_rig(frozen, first_byte_timeout=30)
    waiting = asyncio.create_task(rig.forward())
    await asyncio.wait_for(started.wait(), 5)
    assert rig.activity.in_flight == 1
    assert rig.activity.abort_all() == 1  # what the monitor does when it finds the engine stuck
    with pytest.raises(EngineUnavailableError, match="stopped generating") as caught:
        await asyncio.wait_for(waiting, 5)
    assert caught.value.status_code == 503 and "Retry-After" in caught.value.headers
    assert rig.errors() == {"frozen": 1.0}
    assert rig.settled == [None]
    assert rig.activity.in_flight == 0


async def test_two_requests_with_one_client_id_reach_the_engine_with_different_ids(make_rig: Any) -> None:
    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"choices": []})

    rig = await make_rig(ok)
    await asyncio.gather(rig.forward(request_id="same"), rig.forward(request_id="same"))
    assert len(set(rig.seen_ids)) == 2 and all(seen.startswith("same-") for seen in rig.seen_ids)


# --- an admission running beside the exchange (a key admitted last time: `RequestLease.acquire_beside`) ---

REFUSAL_HEADERS = {"x-ratelimit-remaining-requests": "0"}


def _admission(after: float, *, refused: bool) -> asyncio.Task[None]:
    """The key's admission as a task: it ends after `after` seconds, with a 429 when `refused`."""

    async def admit() -> None:
        await asyncio.sleep(after)
        if refused:
            raise rate_limit_error("Rate limit exceeded: requests per minute (limit 1).", 2000, REFUSAL_HEADERS)

    return asyncio.create_task(admit())


def _engine_working(started: asyncio.Event, ended: list[str]) -> Handler:
    """An engine that works on every request for 5 s, recording how each one ended."""

    async def working(request: web.Request) -> web.Response:
        started.set()
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            ended.append("aborted")  # its client's connection closed: what vLLM aborts on
            raise
        ended.append("answered")
        return web.json_response({"choices": [], "usage": USAGE})

    return working


@pytest.mark.parametrize("stream", [False, True])
async def test_a_refusal_while_the_engine_works_aborts_it_and_answers_the_429(make_rig: Any, stream: bool) -> None:
    started, ended = asyncio.Event(), list[str]()
    rig = await make_rig(_engine_working(started, ended))
    admitting = _admission(0.2, refused=True)
    with pytest.raises(RateLimitError) as caught:
        await asyncio.wait_for(rig.forward(stream=stream, admitting=admitting), 3)
    assert started.is_set(), "the request went on to the engine while the admission ran"
    assert caught.value.status_code == 429 and caught.value.headers["x-ratelimit-remaining-requests"] == "0"
    await async_wait_until(lambda: ended == ["aborted"], within=3, message=f"the engine's request: {ended}")
    # Settled once (a refused lease holds nothing to give back), and no engine error counted.
    assert len(rig.settled) == 1 and rig.errors() == {}
    assert rig.activity.in_flight == 0


@pytest.mark.parametrize("stream", [False, True])
async def test_a_refusal_after_the_engine_answered_still_wins(make_rig: Any, stream: bool) -> None:
    async def quick(request: web.Request) -> web.StreamResponse:
        if not stream:
            return web.json_response({"choices": [], "usage": USAGE})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n')
        await asyncio.sleep(5)  # a long stream the refusal ends
        return response

    rig = await make_rig(quick)
    with pytest.raises(RateLimitError):
        await asyncio.wait_for(rig.forward(stream=stream, admitting=_admission(0.3, refused=True)), 3)
    assert len(rig.settled) == 1 and rig.errors() == {}
    assert rig.activity.in_flight == 0


@pytest.mark.parametrize("stream", [False, True])
async def test_an_admission_that_passes_late_lets_the_answer_out_with_the_keys_headers(
    make_rig: Any, stream: bool
) -> None:
    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"choices": [], "usage": USAGE})

    rig = await make_rig(ok)
    admitting = _admission(0.2, refused=False)
    answer = await asyncio.wait_for(rig.forward(stream=stream, admitting=admitting), 3)
    assert admitting.done(), "nothing goes to the client before the key is admitted"
    if stream:
        assert isinstance(answer, SSERelay)
        sent: list[Message] = []

        async def send(message: Message) -> None:
            sent.append(message)

        await answer({"type": "http"}, _never_disconnects, send)
        assert (b"x-ratelimit-limit-requests", b"10") in sent[0]["headers"]
    else:
        assert isinstance(answer, BufferedAnswer) and answer.status == 200
        assert (b"x-ratelimit-limit-requests", b"10") in answer.headers
        assert rig.settled == [7]


async def test_an_engine_failure_during_the_admission_is_the_engines_error_settled_once(make_rig: Any) -> None:
    rig = await make_rig(None)  # nothing listens
    admitting = _admission(0.3, refused=False)
    with pytest.raises(EngineRefusedError):
        await rig.forward(admitting=admitting)
    assert rig.settled == [0] and rig.errors() == {"refused": 1.0}
    await admitting  # the lease's release waits for it (tests/integration/test_ratelimiter.py)
