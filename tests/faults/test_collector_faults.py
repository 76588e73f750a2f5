"""A trace collector that is down, blackholed or refusing, behind a real gateway under live traffic: every request
still succeeds, and the spans that could not go out are counted in nemotron_gateway_trace_spans_dropped_total.

Down: nothing listens on the endpoint's port. Blackholed: the receiver takes the connection and the request and never
answers (the export thread waits out its timeout while the small queue fills: `queue_full`). Refusing: it answers
every export 503 (retried within the timeout, then dropped: `export_failed`). How much a request pays for tracing is
the overhead benchmark's question (`make bench`); here the answer must be all 200s.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator

import httpx
import pytest

from tests.faults.conftest import chat_body, gateway_on
from tests.otlp import Receiver, running_receiver
from tests.procs import FakeEngineControl, free_port, wait_until

pytestmark = [pytest.mark.faults, pytest.mark.timeout(120)]

REQUESTS = 60
STREAMS = 8
# Small batches and a small queue, so a few dozen requests fill it; a short export timeout (seconds, as the Python SDK
# reads OTEL_EXPORTER_OTLP_TIMEOUT).
TRACING = {
    "OTEL_BSP_SCHEDULE_DELAY": "50",
    "OTEL_BSP_MAX_QUEUE_SIZE": "16",
    "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "8",
    "OTEL_EXPORTER_OTLP_TIMEOUT": "1",
}


@contextlib.contextmanager
def collector(kind: str) -> Iterator[tuple[str, Receiver | None]]:
    """The OTLP endpoint of a collector that is `kind`: down, blackholed or refusing."""
    if kind == "down":
        yield f"http://127.0.0.1:{free_port()}", None
        return
    with running_receiver() as receiver:
        if kind == "blackholed":
            receiver.hold = threading.Event()
        else:
            receiver.refuse = 503
        yield receiver.url, receiver


def dropped(url: str) -> dict[str, float]:
    found: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith("nemotron_gateway_trace_spans_dropped_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            found[reason] = float(line.rsplit(" ", 1)[1])
    return found


@pytest.mark.parametrize("kind", ["down", "blackholed", "refusing"])
async def test_requests_succeed_and_the_spans_lost_are_counted(
    fault_engine: FakeEngineControl, redis_url: str, kind: str
) -> None:
    fault_engine.reset()
    with (
        collector(kind) as (endpoint, receiver),
        gateway_on(fault_engine, redis_url, OTEL_EXPORTER_OTLP_ENDPOINT=endpoint, **TRACING) as gateway,
    ):
        url = f"{gateway.url}/v1/chat/completions"
        plain, streamed = (
            chat_body(stream=False, max_tokens=2, token_delay=0),
            chat_body(max_tokens=4, token_delay=0.01),
        )
        async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=5.0)) as client:

            async def one(body: dict[str, object]) -> int:
                async with client.stream("POST", url, json=body, headers=gateway.headers) as answer:
                    await answer.aread()
                    return answer.status_code

            statuses = [await one(plain) for _ in range(REQUESTS)]
            statuses += await asyncio.gather(*(one(streamed) for _ in range(STREAMS)))
        assert statuses == [200] * (REQUESTS + STREAMS)
        # A blackhole holds the export thread while the queue fills; a refusal or a refused connection fails the
        # export once its retries are over.
        reason = "queue_full" if kind == "blackholed" else "export_failed"
        wait_until(
            lambda: dropped(gateway.url).get(reason, 0),
            timeout=30,
            message=f"no span counted as dropped ({reason}) with the collector {kind}",
        )
        if receiver is not None:
            assert receiver.requests >= 1 and receiver.spans() == []
        assert "the trace collector did not take" in gateway.proc.log_text() or kind == "blackholed"
