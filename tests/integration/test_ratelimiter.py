"""RedisRateLimiter and FailedAuthGuard against a real Redis: exact admission across processes, leases, tokens."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import pytest
import redis.asyncio as redis_asyncio
from pydantic import SecretStr

from gateway.auth import ApiKey, KeyLimits
from gateway.errors import KeyStoreUnavailableError, RateLimitError
from gateway.ratelimit import FailedAuthGuard, Lease, RedisRateLimiter, RequestLease
from gateway.redis import connect_redis
from gateway.settings import AuthSettings, RateLimitSettings, RedisSettings, Settings
from tests.procs import async_wait_until, free_port

pytestmark = pytest.mark.timeout(15)

# An hour-long window makes buckets drain by a negligible amount while a test runs, so counts are exact.
HOUR = 3600.0
# Redis's TIME (the limiter's clock, in whole milliseconds) against this process's monotonic clock.
_CLOCKS = 0.005


def _key(rpm: int | None = 0, tpm: int | None = 0, concurrency: int | None = 0, name: str = "alice") -> ApiKey:
    return ApiKey(name=name, prefix="sk-abcdef", created_at=datetime.now(UTC), limits=KeyLimits(rpm, tpm, concurrency))


def _settings(url: str, redis: RedisSettings | None = None, **limits: Any) -> Settings:
    return Settings(
        redis_url=SecretStr(url),
        redis=redis or RedisSettings(),
        limits=RateLimitSettings.model_validate({"window": HOUR, **limits}),
        auth=AuthSettings(failed_auth_limit=3, failed_auth_window=5.0, failed_auth_block=0.5),
    )


class Processes:
    """Gateway processes sharing the test Redis: each has its own client and its own limiter."""

    def __init__(self, url: str, redis: RedisSettings | None = None) -> None:
        self.url = url
        self.redis = redis
        self._clients: list[redis_asyncio.Redis] = []
        self._limiters: list[RedisRateLimiter] = []
        self._guards: list[FailedAuthGuard] = []

    async def limiter(self, start: bool = True, **limits: Any) -> RedisRateLimiter:
        settings = _settings(self.url, self.redis, **limits)
        client = connect_redis(settings)
        self._clients.append(client)
        limiter = RedisRateLimiter(client, settings)
        if start:
            await limiter.start()
        self._limiters.append(limiter)
        return limiter

    async def warm_up(self, connections: int) -> None:
        """Open pool connections ahead of a burst: redis-py spends ~3 ms of blocking work per new connection
        (it reads its own package metadata), which on a busy machine can push a cold burst past the timeouts."""
        for client in self._clients:
            await asyncio.gather(*(client.ping() for _ in range(connections)), return_exceptions=True)

    async def guard(self) -> FailedAuthGuard:
        settings = _settings(self.url, self.redis)
        client = connect_redis(settings)
        self._clients.append(client)
        guard = FailedAuthGuard(client, settings)
        await guard.start()
        self._guards.append(guard)
        return guard

    async def close(self) -> None:
        for guard in self._guards:
            await guard.stop()
        for limiter in self._limiters:
            await limiter.stop()
        for client in self._clients:
            await client.aclose()


@pytest.fixture
async def processes(redis_clean: str) -> AsyncIterator[Processes]:
    running = Processes(redis_clean)
    yield running
    await running.close()


async def _admitted(limiter: RedisRateLimiter, key: ApiKey, tokens: int = 0) -> Lease | None:
    """A lease if `key` is admitted now, else None (for waiting until it is)."""
    try:
        return await limiter.acquire(key, tokens)
    except RateLimitError:
        return None


async def _refused(limiter: RedisRateLimiter, key: ApiKey, tokens: int = 0) -> RateLimitError:
    with pytest.raises(RateLimitError) as caught:
        await limiter.acquire(key, tokens)
    return caught.value


async def test_requests_per_minute_is_exact_across_processes(processes: Processes) -> None:
    rate = 20
    first, second = await processes.limiter(window=60.0), await processes.limiter(window=60.0)
    await processes.warm_up(3 * rate)
    key = _key(rpm=rate)
    started = time.monotonic()
    outcomes = await asyncio.gather(
        *((first if i % 2 else second).acquire(key, 0) for i in range(5 * rate)), return_exceptions=True
    )
    elapsed = time.monotonic() - started
    admitted = [o for o in outcomes if isinstance(o, Lease)]
    refused = [o for o in outcomes if isinstance(o, RateLimitError)]
    assert (len(admitted), len(refused)) == (rate, 4 * rate)
    for error in refused:
        assert "requests per minute (limit 20)" in error.message
        # The next slot frees 60/20 = 3 s after the burst began.
        assert 3.0 - elapsed - 0.05 <= error.retry_after <= 3.0
        assert error.headers["Retry-After"] == "3"
        assert error.headers["x-ratelimit-remaining-requests"] == "0"
    assert admitted[-1].headers["x-ratelimit-limit-requests"] == "20"


async def test_retry_after_is_when_the_retry_is_admitted(processes: Processes) -> None:
    limiter = await processes.limiter(window=1.0)
    key = _key(rpm=4)  # one request per 250 ms after the burst
    burst_at = time.monotonic()
    for _ in range(4):
        await limiter.acquire(key, 0)
    error = await _refused(limiter, key)
    # When the first slot frees, less however long the burst took (a bracket of two clock reads, not a race).
    assert 0.25 - (time.monotonic() - burst_at) - _CLOCKS <= error.retry_after <= 0.25
    await asyncio.sleep(0.1)
    later = await _refused(limiter, key)
    assert 0 < later.retry_after <= error.retry_after - 0.1
    await asyncio.sleep(later.retry_after)
    await limiter.acquire(key, 0)


async def test_concurrency_refusal_consumes_no_request_slot(processes: Processes) -> None:
    limiter = await processes.limiter()
    key = _key(rpm=3, concurrency=2)
    a = await limiter.acquire(key, 0)
    await limiter.acquire(key, 0)
    error = await _refused(limiter, key)
    assert "in flight" in error.message and "requests per" not in error.message
    assert error.headers["x-ratelimit-remaining-requests"] == "1"
    await limiter.release(a)
    third = await limiter.acquire(key, 0)  # would be refused for rpm had the refusal consumed a slot
    assert third.headers["x-ratelimit-remaining-requests"] == "0"
    assert "requests per" in (await _refused(limiter, key)).message


async def test_tokens_admit_exactly_the_limit_and_refund(processes: Processes) -> None:
    limiter = await processes.limiter()
    key = _key(tpm=1000)
    drained_at = time.monotonic()
    first = await limiter.acquire(key, 600)
    second = await limiter.acquire(key, 400)  # 100% of the limit, not 70-90%
    assert second.headers["x-ratelimit-remaining-tokens"] == "0"
    error = await _refused(limiter, key, 1)
    assert "tokens per" in error.message and "limit 1000" in error.message
    # One token per 3.6 s on a 1000/hour bucket, less what dripped back since it was drained.
    assert 3.6 - (time.monotonic() - drained_at) - _CLOCKS <= error.retry_after <= 3.6
    await limiter.release(first, 100)  # 500 of the estimate come back
    refilled = await limiter.acquire(key, 500)
    assert refilled.headers["x-ratelimit-remaining-tokens"] == "0"
    await _refused(limiter, key, 1)
    # Using more than estimated is charged; the key waits for exactly the overdraft, it is not locked out.
    await limiter.release(second, 500)
    debt = await _refused(limiter, key, 0)
    # The refill took 500 of 500 and what had dripped back since the bucket was drained, which is still in it:
    # the wait is the overdraft less the time since the drain (since the refill, it fails on a busy machine).
    assert 100 * 3.6 - (time.monotonic() - drained_at) - _CLOCKS <= debt.retry_after <= 100 * 3.6


async def test_a_request_that_never_reached_the_engine_costs_the_key_nothing(processes: Processes) -> None:
    # Refused by the engine's admission, or the engine down: its request, its tokens and its usage are given back.
    limiter = await processes.limiter()
    key = _key(rpm=3, tpm=1000)
    for _ in range(10):
        await limiter.release(await limiter.acquire(key, 300), 0, served=False)
    served = [await limiter.acquire(key, 300) for _ in range(3)]  # would be refused for rpm had those counted
    assert served[-1].headers["x-ratelimit-remaining-requests"] == "0"
    assert "requests per" in (await _refused(limiter, key)).message
    for lease in served:
        await limiter.release(lease, 100)
    usage = (await limiter.usage([key.name]))[key.name]
    assert (usage.requests, usage.tokens) == (3, 300)
    await limiter.release(served[0], 0, served=False)  # a second release of a lease changes nothing
    assert "requests per" in (await _refused(limiter, key)).message


async def test_request_larger_than_the_token_limit(processes: Processes) -> None:
    limiter = await processes.limiter()
    error = await _refused(limiter, _key(tpm=1000), 1001)
    assert "Request too large" in error.message and "1001" in error.message


async def test_unlimited_key_still_records_usage(processes: Processes) -> None:
    limiter = await processes.limiter()
    key = _key(rpm=0, tpm=0, concurrency=0)
    leases = [await limiter.acquire(key, 10) for _ in range(50)]
    assert leases[0].headers == {}
    for lease in leases:
        await limiter.release(lease, 3)
    usage = (await limiter.usage([key.name]))[key.name]
    assert (usage.requests, usage.tokens) == (50, 150)


async def test_lease_of_a_dead_process_expires(processes: Processes) -> None:
    crashed = await processes.limiter(start=False, lease_ttl=0.3, lease_renew_interval=0.1)
    survivor = await processes.limiter(lease_ttl=0.3, lease_renew_interval=0.1)
    key = _key(concurrency=1)
    await crashed.acquire(key, 0)  # never released, never renewed
    await _refused(survivor, key)
    await async_wait_until(lambda: _admitted(survivor, key), within=10, message="the dead process's slot never expired")


async def test_renewal_keeps_a_long_stream_alive(processes: Processes) -> None:
    # Renewed every 0.1 s, the slot outlives twice its TTL; the TTL leaves a busy machine 1.9 s to run a renewal.
    limiter = await processes.limiter(lease_ttl=2.0, lease_renew_interval=0.1)
    other = await processes.limiter(lease_ttl=2.0, lease_renew_interval=0.1)
    key = _key(concurrency=1)
    lease = await limiter.acquire(key, 0)
    await asyncio.sleep(4.5)  # over twice the TTL
    assert "in flight" in (await _refused(other, key)).message
    await limiter.release(lease)
    await other.acquire(key, 0)


async def test_release_is_idempotent_and_survives_cancellation(processes: Processes) -> None:
    limiter = await processes.limiter()
    key = _key(concurrency=1)
    admitted = asyncio.Event()

    async def request() -> None:
        lease = await limiter.acquire(key, 0)
        try:
            admitted.set()
            await asyncio.sleep(10)
        finally:
            await limiter.release(lease)

    task = asyncio.create_task(request())
    await admitted.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    lease = await limiter.acquire(key, 0)  # the cancelled request's slot is free

    # Cancelled while releasing: the release still completes.
    releasing = asyncio.create_task(limiter.release(lease))
    await asyncio.sleep(0)
    releasing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await releasing
    await limiter.release(lease)  # second call: no-op
    await async_wait_until(lambda: _admitted(limiter, key), within=10, message="the slot was never freed")


async def test_an_admission_sent_after_a_release_on_the_same_connection_runs_after_it(processes: Processes) -> None:
    # A release returns once its script is written, before Redis answers; one process's scripts share one
    # connection, which Redis reads in order: the admission that follows finds the slot free, every time. (Across
    # processes the client's round trip orders them: tests/integration/test_workers.py.)
    limiter = await processes.limiter()
    key = _key(concurrency=1)
    await limiter.release(await limiter.acquire(key, 0))  # the release script has run on the connection
    for _ in range(200):
        lease = await limiter.acquire(key, 0)
        await limiter.release(lease)


async def test_request_cancelled_during_admission_leaks_nothing(processes: Processes) -> None:
    limiter = await processes.limiter()
    key = _key(tpm=100, concurrency=1)
    admitting = asyncio.create_task(limiter.acquire(key, 100))
    await asyncio.sleep(0)  # the script is on its way to Redis
    admitting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await admitting
    # Slot and tokens come back.
    lease = await async_wait_until(lambda: _admitted(limiter, key, 100), within=10, message="the admission leaked")
    await limiter.release(lease)
    assert (await limiter.usage([key.name]))[key.name].requests == 1  # the cancelled one was never served


async def test_failed_auth_guard_blocks_and_unblocks(processes: Processes) -> None:
    guard, elsewhere = await processes.guard(), await processes.guard()
    await async_wait_until(lambda: guard.subscribed and elsewhere.subscribed, within=10)
    for _ in range(2):
        await guard.record_failure("203.0.113.7")
        await guard.check("203.0.113.7")
    blocked_at = time.monotonic()
    await elsewhere.record_failure("203.0.113.7")  # the third, counted in another process

    async def blocked_here() -> bool:
        try:
            await guard.check("203.0.113.7")
        except RateLimitError:
            return True
        return False

    # The block reaches the first process by pub/sub: checking costs no Redis round trip.
    await async_wait_until(blocked_here, within=5)
    for process in (guard, elsewhere):
        with pytest.raises(RateLimitError) as caught:
            await process.check("203.0.113.7")
        # The block's 0.5 s, less what has passed of it (a bracket of two clock reads, not a race).
        assert 0.5 - (time.monotonic() - blocked_at) - _CLOCKS <= caught.value.retry_after <= 0.5
        assert "failed authentication" in caught.value.message
    await guard.check("198.51.100.1")  # other addresses are untouched
    await async_wait_until(lambda: guard.blocked("203.0.113.7") is None, within=10)
    await async_wait_until(lambda: elsewhere.blocked("203.0.113.7") is None, within=10)


async def test_redis_down_fails_closed_quickly_or_open_when_configured() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    # Deadlines past the test's own timeout: a refused connection must fail at once, as waiting for any deadline
    # could not end before the test is stopped.
    patient = RedisSettings(connect_timeout=60.0, socket_timeout=60.0, command_timeout=60.0)
    down = Processes(url, redis=patient)
    try:
        closed, opened = await down.limiter(), await down.limiter(fail_open=True)
        with pytest.raises(KeyStoreUnavailableError):
            await closed.acquire(_key(rpm=1), 0)
        lease = await opened.acquire(_key(rpm=1), 0)
        assert lease.degraded
        await opened.release(lease)
        guard = await down.guard()
        await guard.record_failure("203.0.113.7")
        await guard.check("203.0.113.7")  # a brake, not a gate: authentication itself fails closed
    finally:
        await down.close()


async def test_precheck_repeats_a_requests_or_concurrency_refusal_without_redis(processes: Processes) -> None:
    limiter = await processes.limiter()
    key, other = _key(rpm=2, concurrency=0), _key(concurrency=1, name="bob")
    limiter.precheck(key)  # never refused: passes
    for _ in range(2):
        await limiter.acquire(key, 0)
    refusal = await _refused(limiter, key)
    with pytest.raises(RateLimitError) as caught:
        limiter.precheck(key)
    assert caught.value.message == refusal.message
    assert 0 < caught.value.retry_after <= refusal.retry_after
    assert caught.value.headers["x-ratelimit-remaining-requests"] == "0"

    # A concurrency refusal lapses as soon as this process frees a slot of the key.
    held = await limiter.acquire(other, 0)
    await _refused(limiter, other)
    with pytest.raises(RateLimitError):
        limiter.precheck(other)
    await limiter.release(held)
    limiter.precheck(other)


async def test_precheck_ignores_token_refusals(processes: Processes) -> None:
    # precheck is synchronous: it cannot wait on Redis. A token refusal depends on the request's size, which
    # precheck does not know (no body yet), so it is not repeated.
    limiter = await processes.limiter()
    big = _key(tpm=10, name="dave")
    await _refused(limiter, big, 11)
    limiter.precheck(big)


# --- admission beside the request (`limits.overlap_admission`, `RequestLease.acquire_beside`) ---


async def test_a_key_is_admitted_beside_its_request_only_after_an_admission_and_one_at_a_time(
    processes: Processes,
) -> None:
    limiter = await processes.limiter(overlap_admission=True)
    key = _key(rpm=3)
    first = RequestLease(limiter, key, "chat")
    assert first.acquire_beside(0) is None, "a key this process has not admitted yet is admitted first"
    await first.acquire(0)
    second, third = RequestLease(limiter, key, "chat"), RequestLease(limiter, key, "chat")
    beside = second.acquire_beside(0)
    assert beside is not None
    assert third.acquire_beside(0) is None, "one admission of a key beside its request at a time"
    await beside
    beside = third.acquire_beside(0)
    assert beside is not None
    await beside
    assert third.headers["x-ratelimit-remaining-requests"] == "0"
    fourth = RequestLease(limiter, key, "chat")
    refused = fourth.acquire_beside(0)
    assert refused is not None
    with pytest.raises(RateLimitError):
        await refused
    assert fourth.headers == {}, "a refused lease holds nothing"
    await fourth.release(0)
    assert RequestLease(limiter, key, "chat").acquire_beside(0) is None, "refused last time: admitted first again"
    for lease in (first, second, third):
        await lease.release(0)
    assert (await limiter.usage([key.name]))[key.name].requests == 3


async def test_keys_are_admitted_first_with_overlap_admission_off_or_without_limits(processes: Processes) -> None:
    serial = await processes.limiter()  # overlap_admission is off by default
    key = _key(rpm=10)
    await RequestLease(serial, key, "chat").acquire(0)
    assert RequestLease(serial, key, "chat").acquire_beside(0) is None
    limiter = await processes.limiter(overlap_admission=True)
    unlimited = _key(name="carol")
    await RequestLease(limiter, unlimited, "chat").acquire(0)
    assert RequestLease(limiter, unlimited, "chat").acquire_beside(0) is None, "no limits: no Redis call to overlap"


async def test_a_release_before_the_admission_beside_ends_gives_back_what_it_took(processes: Processes) -> None:
    limiter = await processes.limiter(overlap_admission=True)
    key = _key(rpm=10, tpm=100, concurrency=1)
    await limiter.release(await limiter.acquire(key, 0))
    lease = RequestLease(limiter, key, "chat")
    admitting = lease.acquire_beside(100)
    assert admitting is not None and not admitting.done()
    await lease.release(0, served=False)  # the exchange failed before Redis answered
    assert admitting.done()
    # The slot and the 100 tokens are free again, and the request is not charged to the key.
    again = await limiter.acquire(key, 100)
    await limiter.release(again)
    assert (await limiter.usage([key.name]))[key.name].requests == 2


async def test_a_release_cancelled_while_the_admission_beside_runs_still_happens(processes: Processes) -> None:
    limiter = await processes.limiter(overlap_admission=True)
    key = _key(concurrency=1)
    await limiter.release(await limiter.acquire(key, 0))
    lease = RequestLease(limiter, key, "chat")
    admitting = lease.acquire_beside(0)
    assert admitting is not None
    releasing = asyncio.create_task(lease.release(0))
    await asyncio.sleep(0)  # waiting for the admission
    releasing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await releasing
    lease_again = await async_wait_until(lambda: _admitted(limiter, key), within=10, message="the slot leaked")
    await limiter.release(lease_again)
