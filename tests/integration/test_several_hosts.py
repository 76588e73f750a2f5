"""Several gateway hosts sharing one Redis: two `nemotron-gateway serve` processes on their own ports (standing
in for two VMs behind nginx) hold each key's limits exactly across both, under concurrent load.

Requests are spread over both hosts at once; what one host admitted counts on the other, because every
admission is one Lua script in the shared Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Iterator
from itertools import cycle

import httpx
import pytest

from tests.faults.conftest import GATEWAY_ENV, create_key
from tests.procs import FakeEngineControl, ServerProcess, run_gateway

pytestmark = pytest.mark.timeout(120)

MODEL = "nemotron-test"
# The per-minute limits refer to an hour here: nothing leaks back into a bucket while a test runs.
ENV = {**GATEWAY_ENV, "NEMOTRON_LIMITS__WINDOW": "3600"}


@pytest.fixture
def hosts(engine: FakeEngineControl, redis_clean: str) -> Iterator[list[str]]:
    """Two gateways in front of one engine, sharing one Redis; their base URLs."""
    with contextlib.ExitStack() as stack:
        processes: list[ServerProcess] = [
            stack.enter_context(run_gateway(engine.base_url, redis_clean, env=ENV)) for _ in range(2)
        ]
        yield [f"http://127.0.0.1:{process.port}" for process in processes]


def _key(redis_url: str, **limits: int) -> dict[str, str]:
    secret = create_key(redis_url, f"hosts-{uuid.uuid4().hex[:8]}", **limits)
    return {"Authorization": f"Bearer {secret}"}


def _completion(max_tokens: int, *, stream: bool = False, token_delay: float = 0.0) -> dict[str, object]:
    # The prompt "hi" is estimated at 1 token: a request is charged 1 + max_tokens up front.
    return {
        "model": MODEL,
        "prompt": "hi",
        "max_tokens": max_tokens,
        "stream": stream,
        "fake_token_delay": token_delay,
    }


async def _hold_streams(hosts: list[str], headers: dict[str, str], count: int, body: dict[str, object]) -> list[int]:
    """Open `count` streams at once, alternating between the hosts; the statuses, taken while all are open."""
    async with httpx.AsyncClient(timeout=30.0) as client, contextlib.AsyncExitStack() as streams:

        async def open_one(host: str) -> int:
            request = client.stream("POST", f"{host}/v1/completions", json=body, headers=headers)
            response = await streams.enter_async_context(request)
            return response.status_code

        return list(await asyncio.gather(*(open_one(host) for host, _ in zip(cycle(hosts), range(count)))))


async def test_max_concurrency_holds_across_hosts(hosts: list[str], redis_clean: str) -> None:
    headers = _key(redis_clean, max_concurrency=2)
    long_stream = _completion(200, stream=True, token_delay=0.05)  # ~10 s: every stream is open meanwhile
    statuses = await _hold_streams(hosts, headers, 6, long_stream)
    assert sorted(statuses) == [200, 200, 429, 429, 429, 429], statuses
    # Closed, each slot is freed for both hosts (after the refusals' Retry-After of 1 s: a host that refused
    # answers from its memory of that refusal until then, and the releases land meanwhile).
    await asyncio.sleep(1.2)
    assert await _hold_streams(hosts, headers, 2, long_stream) == [200, 200]


async def test_requests_per_minute_admit_exactly_n_across_hosts(hosts: list[str], redis_clean: str) -> None:
    limit = 10
    headers = _key(redis_clean, rpm=limit)
    async with httpx.AsyncClient(timeout=30.0) as client:
        responses = await asyncio.gather(
            *(
                client.post(f"{host}/v1/completions", json=_completion(1), headers=headers)
                for host, _ in zip(cycle(hosts), range(3 * limit))
            )
        )
    statuses = [response.status_code for response in responses]
    assert statuses.count(200) == limit, statuses
    assert statuses.count(429) == 2 * limit, statuses
    # Both hosts refused: the limit is the key's, not a host's.
    refused_by = {str(response.url).rsplit("/v1", 1)[0] for response in responses if response.status_code == 429}
    assert refused_by == set(hosts)


async def test_tokens_per_minute_admit_exactly_what_fits_across_hosts(hosts: list[str], redis_clean: str) -> None:
    # Each stream is charged 1 + 99 = 100 tokens up front: ten fit in 1050, the eleventh does not.
    headers = _key(redis_clean, tpm=1050)
    statuses = await _hold_streams(hosts, headers, 24, _completion(99, stream=True, token_delay=0.05))
    assert statuses.count(200) == 10, statuses
    assert statuses.count(429) == 14, statuses
