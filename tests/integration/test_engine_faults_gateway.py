"""The gateway in front of a misbehaving fake engine: busy (late /health), frozen (no token, /health 200), stopped
(SIGSTOP), and clients sharing a request id. What clients see, and within which bound.

The bound comes from the relay settings below (see RelaySettings.stall_timeout): a stuck engine is refused within
max(stall, generation probe + 2 x interval) + interval seconds when busy, generation probe + 2 x interval when idle.
The ordinary tests check that the gateway's finding ends the streams and refuses requests (the 60 s chunk timeout
ends a frozen stream with another error); the `perf` ones time it, with generous slack for a loaded machine.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from tests.procs import FakeEngineControl, ServerProcess, async_wait_until, run_gateway, wait_until

pytestmark = pytest.mark.timeout(120)

MODEL = "nemotron-test"
PROBE_INTERVAL, GENERATION_PROBE_TIMEOUT, STALL_TIMEOUT, CHUNK_TIMEOUT = 0.5, 2.0, 3.0, 60.0
BUSY_BOUND = max(STALL_TIMEOUT, GENERATION_PROBE_TIMEOUT + 2 * PROBE_INTERVAL) + PROBE_INTERVAL
IDLE_BOUND = GENERATION_PROBE_TIMEOUT + 2 * PROBE_INTERVAL
SLACK = 10.0  # a loaded two-core machine; still far below CHUNK_TIMEOUT
# Waits that only stop a hung test: the gateway's finding comes within the bounds above.
HANG_GUARD = 60.0

GATEWAY_ENV = {
    "NEMOTRON_AUTH__ENABLED": "false",
    "NEMOTRON_RELAY__PROBE_INTERVAL": str(PROBE_INTERVAL),
    "NEMOTRON_RELAY__PROBE_TIMEOUT": "1",
    "NEMOTRON_RELAY__GENERATION_PROBE_TIMEOUT": str(GENERATION_PROBE_TIMEOUT),
    "NEMOTRON_RELAY__STALL_TIMEOUT": str(STALL_TIMEOUT),
    "NEMOTRON_RELAY__CHUNK_TIMEOUT": str(CHUNK_TIMEOUT),
    "NEMOTRON_RELAY__HEARTBEAT_INTERVAL": "1",
    "NEMOTRON_RELAY__RETRY_AFTER": "2",
}


@pytest.fixture(scope="module")
def gateway(fake_engine: FakeEngineControl, redis_url: str) -> Iterator[ServerProcess]:
    with run_gateway(fake_engine.base_url, redis_url, env=GATEWAY_ENV) as proc:
        yield proc


@pytest.fixture
def base_url(gateway: ServerProcess, engine: FakeEngineControl) -> Iterator[str]:
    url = f"http://127.0.0.1:{gateway.port}"
    yield url
    # Whatever a test did, the next one starts with a generating engine and a ready gateway.
    engine.freeze(False)
    engine.process.send_signal(signal.SIGCONT)
    wait_until(lambda: httpx.get(f"{url}/ready", timeout=5).status_code == 200, timeout=30)


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], **extra}


def data_events(raw: bytes) -> list[bytes]:
    return [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: ")]


async def _stream(client: httpx.AsyncClient, body: dict[str, Any], first: asyncio.Event | None = None) -> bytes:
    raw = b""
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for chunk in response.aiter_raw():
            raw += chunk
            if first is not None and b"data: " in raw:
                first.set()
    return raw


async def test_busy_engine_whose_health_answers_late_is_never_refused(base_url: str, engine: FakeEngineControl) -> None:
    # /health answers after 3 s, beyond the 1 s probe timeout, while tokens stream at full speed.
    await engine.aset_health(200, delay=3.0)
    statuses: list[int] = []
    ready: list[int] = []
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        for _ in range(3):  # ~2 s a round: several probe intervals, several late probes
            streams = [_stream(client, chat(max_tokens=40, stream=True, fake_token_delay=0.05)) for _ in range(8)]
            plain = [client.post("/v1/chat/completions", json=chat(max_tokens=4)) for _ in range(4)]
            raws, answers = await asyncio.gather(asyncio.gather(*streams), asyncio.gather(*plain))
            statuses += [answer.status_code for answer in answers]
            assert all(data_events(raw)[-1] == b"[DONE]" for raw in raws)
            ready.append((await client.get("/ready")).status_code)
    assert statuses == [200] * 12
    assert ready == [200] * 3
    assert (await engine.astats())["health_checks"] >= 3, "the late /health probes did happen"


async def _streams_ended_by_a_freeze(client: httpx.AsyncClient, engine: FakeEngineControl) -> list[float]:
    """Four streams, then the engine frozen (/health still 200, no further token): when each stream ended, from the
    freeze, once each is checked to end with the gateway's error saying the engine stopped generating (not the
    chunk timeout's)."""
    started = [asyncio.Event() for _ in range(4)]
    body = chat(max_tokens=500, stream=True, fake_token_delay=0.1)  # 50 s if nothing stops it
    streams = [asyncio.create_task(_stream(client, body, first)) for first in started]
    await asyncio.wait_for(asyncio.gather(*(first.wait() for first in started)), 20)
    await engine.afreeze()
    frozen_at = time.monotonic()
    ended: list[float] = []
    for task in asyncio.as_completed(streams):
        raw = await task
        ended.append(time.monotonic() - frozen_at)
        events = data_events(raw)
        errors = [orjson.loads(e)["error"] for e in events if e.startswith(b'{"error"')]
        assert len(errors) == 1 and events[-1].startswith(b'{"error"'), events[-3:]
        assert errors[0]["code"] == "engine_unavailable" and "stopped generating" in errors[0]["message"]
    return ended


async def test_frozen_engine_ends_streams_and_is_refused(base_url: str, engine: FakeEngineControl) -> None:
    async with httpx.AsyncClient(base_url=base_url, timeout=CHUNK_TIMEOUT + 30) as client:
        await _streams_ended_by_a_freeze(client, engine)
        refused = await client.post("/v1/chat/completions", json=chat(max_tokens=2))
        assert refused.status_code == 503 and refused.headers["retry-after"] == "2"
        assert "not generating" in refused.json()["error"]["message"]
        ready = await client.get("/ready")
        assert ready.status_code == 503 and ready.json()["engine"]["reason"] == "engine not generating"
        await engine.afreeze(False)

        async def serving() -> bool:
            return (await client.post("/v1/chat/completions", json=chat(max_tokens=2))).status_code == 200

        await async_wait_until(serving, within=30, interval=0.25)


@pytest.mark.perf
async def test_a_frozen_engines_streams_end_within_the_bound(base_url: str, engine: FakeEngineControl) -> None:
    async with httpx.AsyncClient(base_url=base_url, timeout=CHUNK_TIMEOUT + 30) as client:
        ended = await _streams_ended_by_a_freeze(client, engine)
    assert max(ended) < BUSY_BOUND + SLACK, f"streams ended {ended} s after the freeze"


def _refused_once_idle_and_frozen(base_url: str, engine: FakeEngineControl) -> float:
    """The idle engine frozen: seconds until /ready says 503, once a request is refused too."""
    assert httpx.get(f"{base_url}/ready").status_code == 200
    engine.freeze()
    frozen_at = time.monotonic()
    wait_until(lambda: httpx.get(f"{base_url}/ready").status_code == 503, timeout=HANG_GUARD, interval=0.1)
    took = time.monotonic() - frozen_at
    refused = httpx.post(f"{base_url}/v1/chat/completions", json=chat(max_tokens=2), timeout=10)
    assert refused.status_code == 503 and "retry-after" in refused.headers
    return took


def test_idle_frozen_engine_is_refused(base_url: str, engine: FakeEngineControl) -> None:
    _refused_once_idle_and_frozen(base_url, engine)
    engine.freeze(False)
    wait_until(lambda: httpx.get(f"{base_url}/ready").status_code == 200, timeout=30)


@pytest.mark.perf
def test_an_idle_frozen_engine_is_refused_within_the_bound(base_url: str, engine: FakeEngineControl) -> None:
    took = _refused_once_idle_and_frozen(base_url, engine)
    assert took < IDLE_BOUND + SLACK


def test_stopped_engine_process_is_refused_then_recovers(base_url: str, engine: FakeEngineControl) -> None:
    # SIGSTOP: connections are still accepted by the kernel, nothing answers; neither /health nor a generation.
    engine.process.send_signal(signal.SIGSTOP)
    try:
        wait_until(
            lambda: httpx.get(f"{base_url}/ready", timeout=5).status_code == 503,
            timeout=HANG_GUARD,
            interval=0.1,
        )
        refused = httpx.post(f"{base_url}/v1/chat/completions", json=chat(max_tokens=2), timeout=10)
        assert refused.status_code == 503 and "retry-after" in refused.headers
    finally:
        engine.process.send_signal(signal.SIGCONT)
    wait_until(lambda: httpx.get(f"{base_url}/ready", timeout=5).status_code == 200, timeout=30)
    answer = httpx.post(f"{base_url}/v1/chat/completions", json=chat(max_tokens=2), timeout=10)
    assert answer.status_code == 200


async def test_two_clients_with_one_request_id_reach_the_engine_with_different_ids(
    base_url: str, engine: FakeEngineControl
) -> None:
    headers = {"X-Request-ID": "shared-id"}
    async with httpx.AsyncClient(base_url=base_url, timeout=20) as client:
        body = chat(max_tokens=2, fake_prefill_delay=0.5)  # both in the engine at once
        answers = await asyncio.gather(*(client.post("/v1/chat/completions", json=body, headers=headers) for _ in "ab"))
    assert [a.status_code for a in answers] == [200, 200]
    assert [a.headers["x-request-id"] for a in answers] == ["shared-id", "shared-id"]
    seen = [record["request_id"] for record in await engine.arequests()]
    assert len(seen) == 2 and len(set(seen)) == 2
    assert all(request_id.startswith("shared-id-") for request_id in seen)
