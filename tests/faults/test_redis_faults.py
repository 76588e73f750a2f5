"""Redis stopped and restarted under load, seen by clients of a real gateway with a grown Redis pool.

While Redis is down new requests are refused fast (fail closed) and streams already admitted run to
their end; once it answers again no request is refused and the slots those streams held are free within
about a second. The limiter-level cases (a lost reply, a failed release alone) are in
tests/integration/test_redis_faults.py, whose private redis-server this reuses.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.faults.conftest import Figures, StreamOutcome, chat_body, gateway_on, read_stream
from tests.integration.test_redis_faults import PrivateRedis, _connected_clients
from tests.procs import FakeEngineControl, async_wait_until

pytestmark = [pytest.mark.faults, pytest.mark.timeout(120)]

BURST = 80
# Stated bound for 503s once Redis answers again (the target: none).
MAX_503_AFTER_RESTART = 0
# A refusal while Redis is down: the connection is refused at once (typically milliseconds).
FAST_503 = 5.0
# Slots of streams that ended during the outage are freed once Redis answers (within about a second), else only at
# their lease's end (a 30 s TTL): a wait shorter than what is left of it can end only by the release.
SLOT_WAIT = 15.0


@pytest.fixture
def restartable_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    server = PrivateRedis(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


async def test_redis_restart_under_load(
    fault_engine: FakeEngineControl, restartable_redis: PrivateRedis, figures: Figures
) -> None:
    fault_engine.reset()
    with gateway_on(fault_engine, restartable_redis.url, max_concurrency=1000) as gateway:
        url = f"{gateway.url}/v1/chat/completions"
        short = chat_body(stream=False, max_tokens=2, token_delay=0.05)
        limits = httpx.Limits(max_connections=BURST + 20)
        async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=5.0), limits=limits) as client:

            async def burst(count: int) -> list[httpx.Response]:
                return await asyncio.gather(
                    *(client.post(url, json=short, headers=gateway.headers) for _ in range(count))
                )

            assert [r.status_code for r in await burst(BURST)] == [200] * BURST
            connected = await _connected_clients(restartable_redis.url)
            figures("redis_restart.connections", connected, "connections", f"after a burst of {BURST}")
            # Script calls share one pipelined connection per worker (and load a missing script once): the restart
            # below kills those, and the listeners'.
            assert 1 <= connected <= 12, f"the gateway holds {connected} connections to Redis"

            # Streams admitted now end while Redis is down: their slots cannot be released then.
            started = [asyncio.Event() for _ in range(5)]
            stream_body = chat_body(max_tokens=40, token_delay=0.05)
            streams: list[asyncio.Task[StreamOutcome]] = [
                asyncio.create_task(read_stream(client, url, gateway.headers, stream_body, event)) for event in started
            ]
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 30)
            await asyncio.to_thread(restartable_redis.stop)
            down = [await client.post(url, json=short, headers=gateway.headers) for _ in range(10)]
            outcomes = await asyncio.wait_for(asyncio.gather(*streams), 30)
            await asyncio.to_thread(restartable_redis.start)
            answered_at = time.monotonic()
            after = await burst(40)

            for response in down:
                assert response.status_code == 503, response.text
                assert response.headers.get("retry-after", "").isdigit()
            for index, outcome in enumerate(outcomes):
                assert outcome.done and not outcome.errors, f"stream {index} was not completed: {outcome.data[-2:]}"
            refused = [r.status_code for r in after].count(503)
            figures("redis_restart.503s_after_restart", refused, "requests", "of 40 sent as Redis answered again")
            assert refused <= MAX_503_AFTER_RESTART, f"{refused} of 40 requests got 503 after Redis came back"
            assert [r.status_code for r in after] == [200] * 40
            await async_wait_until(
                lambda: gateway.leases() == 0,
                within=SLOT_WAIT,
                message=f"{gateway.leases()} slots still held {SLOT_WAIT} s after Redis answered",
            )
            figures("redis_restart.slots_free_after_s", time.monotonic() - answered_at, "s", "since Redis answered")


@pytest.mark.perf
async def test_requests_are_refused_promptly_while_redis_is_down(
    fault_engine: FakeEngineControl, restartable_redis: PrivateRedis, figures: Figures
) -> None:
    fault_engine.reset()
    with gateway_on(fault_engine, restartable_redis.url) as gateway:
        url = f"{gateway.url}/v1/chat/completions"
        short = chat_body(stream=False, max_tokens=2, token_delay=0.05)
        async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=5.0)) as client:
            assert (await client.post(url, json=short, headers=gateway.headers)).status_code == 200
            await asyncio.to_thread(restartable_redis.stop)
            took = []
            for _ in range(10):
                sent = time.monotonic()
                response = await client.post(url, json=short, headers=gateway.headers)
                took.append(time.monotonic() - sent)
                assert response.status_code == 503, response.text
    figures("redis_down.slowest_503_s", max(took), "s", "fail closed")
    assert max(took) < FAST_503, f"requests took {took} s with Redis down"
