"""HTTP load generators on aiohttp, bounded by a request count and a duration.

`run_load`: the overhead benchmark's closed loop (one body, no parsing, minimal CPU).
`drive_closed` / `drive_open`: the load tool's fixed concurrency and Poisson arrivals at a rate, each request
timed by `loadtest.timing` (TTFT, inter-token gaps, usage).
aiohttp, not httpx, on the client side: httpx's async client costs several times more CPU per request,
and the load generator shares its core with the engine. Imports nothing from `gateway`.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import aiohttp

from loadtest.timing import RequestTiming, percentile, timed_request

_DONE = b"data: [DONE]"
# A load loop never waits longer than this on one request.
REQUEST_TIMEOUT = 30.0


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


BodyFor = Callable[[int], bytes]
OnDone = Callable[[RequestTiming], None]


@dataclass(slots=True)
class Phase:
    """The timed requests of one phase (in completion order) and its wall time, first send to last answer."""

    records: list[RequestTiming]
    wall_s: float


def open_session(*, connections: int, timeout: float, headers: Mapping[str, str]) -> aiohttp.ClientSession:
    """A session whose pool holds `connections` (0: no limit) keep-alive connections, each request `timeout` s."""
    connector = aiohttp.TCPConnector(limit=connections)
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=timeout),
        headers={"Content-Type": "application/json", **headers},
        skip_auto_headers=("User-Agent",),
    )


async def drive_closed(
    http: aiohttp.ClientSession,
    url: str,
    body_for: BodyFor,
    *,
    stream: bool,
    concurrency: int,
    max_requests: int,
    duration: float,
    first_index: int = 0,
    on_done: OnDone | None = None,
) -> Phase:
    """`concurrency` workers, each sending its next request when the last one is answered (closed loop).

    Stops issuing at `max_requests` or after `duration` seconds; requests in flight then are finished.
    """
    records: list[RequestTiming] = []
    issued = 0
    started = time.perf_counter()
    deadline = started + duration

    async def worker() -> None:
        nonlocal issued
        while issued < max_requests and time.perf_counter() < deadline:
            index = first_index + issued
            issued += 1
            sent = time.perf_counter() - started
            record = await timed_request(
                http, url, body_for(index), stream=stream, record=RequestTiming(index, sent, sent)
            )
            records.append(record)
            if on_done is not None:
                on_done(record)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return Phase(records, time.perf_counter() - started)


def arrival_times(rate: float, *, seed: int, max_requests: int, duration: float) -> list[float]:
    """Poisson arrivals at `rate`/s: seconds from the phase start, at most `max_requests`, all before `duration`."""
    rng = random.Random(f"arrivals:{seed}")
    times: list[float] = []
    at = 0.0
    while len(times) < max_requests:
        at += rng.expovariate(rate)
        if at >= duration:
            break
        times.append(at)
    return times


async def drive_open(
    http: aiohttp.ClientSession,
    url: str,
    body_for: BodyFor,
    *,
    stream: bool,
    rate: float,
    max_requests: int,
    duration: float,
    seed: int,
    max_concurrency: int | None = None,
    first_index: int = 0,
    on_done: OnDone | None = None,
) -> Phase:
    """Requests sent at Poisson arrival times, whatever is still in flight (open loop: queueing shows).

    `max_concurrency` caps requests in flight; arrivals then wait for a slot and the wait shows as lag
    (`sent_at - scheduled_at`). No arrival is sent after `duration`; requests in flight then are finished.
    """
    records: list[RequestTiming] = []
    tasks: set[asyncio.Task[None]] = set()
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    started = time.perf_counter()

    async def one(index: int, scheduled: float, sent: float) -> None:
        try:
            record = RequestTiming(index, sent, scheduled)
            await timed_request(http, url, body_for(index), stream=stream, record=record)
            records.append(record)
            if on_done is not None:
                on_done(record)
        finally:
            if slots is not None:
                slots.release()

    for number, at in enumerate(arrival_times(rate, seed=seed, max_requests=max_requests, duration=duration)):
        delay = started + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if slots is not None:
            await slots.acquire()
        # Checked after the waits: an arrival due just before the end, woken late (a busy loop) or after a slot,
        # would be sent past it.
        sent = time.perf_counter() - started
        if sent >= duration:
            if slots is not None:
                slots.release()
            break
        task = asyncio.create_task(one(first_index + number, at, sent))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.gather(*tasks)
    return Phase(records, time.perf_counter() - started)
