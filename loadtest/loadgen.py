"""The overhead benchmark's HTTP load generator on aiohttp, bounded by a request count and a duration.

`run_load`: a closed loop (one body, no parsing, minimal CPU). `nemotron-loadtest` itself sends its load with
vLLM's benchmark client (`loadtest.points`).
aiohttp, not httpx, on the client side: httpx's async client costs several times more CPU per request,
and the load generator shares its core with the engine. Imports nothing from `gateway`.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import aiohttp

_DONE = b"data: [DONE]"
# A load loop never waits longer than this on one request.
REQUEST_TIMEOUT = 30.0


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank quantile; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


@dataclass(slots=True)
class LoadResult:
    """What one phase of load measured, from the client's side."""

    requests: int = 0
    errors: int = 0
    wall_s: float = 0.0
    latencies: list[float] = field(default_factory=list)
    first_byte: list[float] = field(default_factory=list)
    body_reads: int = 0
    first_error: str | None = None

    @property
    def rps(self) -> float:
        """Completed requests per second of wall time."""
        return self.requests / self.wall_s if self.wall_s > 0 else 0.0

    def latency_ms(self, q: float) -> float:
        """The q-quantile (nearest rank) of the total latency, in ms."""
        return percentile(self.latencies, q) * 1000

    def first_byte_ms(self, q: float) -> float:
        """The q-quantile (nearest rank) of the time to the first body bytes (streams), in ms."""
        return percentile(self.first_byte, q) * 1000


async def run_load(
    url: str,
    body: bytes,
    *,
    concurrency: int,
    duration: float,
    max_requests: int,
    stream: bool,
    on_start: Callable[[], None] | None = None,
    on_end: Callable[[], None] | None = None,
    headers: Mapping[str, str] | None = None,
) -> LoadResult:
    """POST `body` to `url` from `concurrency` closed-loop workers until `duration` or `max_requests` is reached.

    Every worker first sends one unrecorded request, so connections are open before the clock starts.
    Requests in flight at the deadline are finished and counted; `wall_s` runs until the last one ends.
    `on_start` and `on_end` bracket the measured requests (to snapshot CPU counters).
    """
    result = LoadResult()
    headers = {"Content-Type": "application/json", **(headers or {})}
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT)
    issued = 0
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, skip_auto_headers=("User-Agent",)) as http:

        async def one(recorded: bool = True) -> None:
            started = time.perf_counter()
            first = 0.0
            async with http.post(url, data=body, headers=headers) as answer:
                if stream:
                    tail = b""
                    async for data in answer.content.iter_any():
                        if not first:
                            first = time.perf_counter()
                        result.body_reads += 1
                        tail = (tail + data)[-32:]
                    ok = answer.status == 200 and _DONE in tail
                else:
                    data = await answer.read()
                    ok = answer.status == 200 and bool(data)
            ended = time.perf_counter()
            if not ok:
                raise RuntimeError(f"HTTP {answer.status}")
            if not recorded:
                return
            result.requests += 1
            result.latencies.append(ended - started)
            if stream:
                result.first_byte.append(first - started)

        async def worker(deadline: float) -> None:
            nonlocal issued
            while issued < max_requests and time.perf_counter() < deadline:
                issued += 1
                try:
                    await one()
                except (aiohttp.ClientError, RuntimeError, TimeoutError) as exc:
                    result.errors += 1
                    result.first_error = result.first_error or f"{type(exc).__name__}: {exc}"

        await asyncio.gather(*(one(recorded=False) for _ in range(concurrency)))
        if on_start is not None:
            on_start()
        started = time.perf_counter()
        deadline = started + duration
        await asyncio.gather(*(worker(deadline) for _ in range(concurrency)))
        result.wall_s = time.perf_counter() - started
        if on_end is not None:
            on_end()
    return result
