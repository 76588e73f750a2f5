"""The one Redis factory against a real Sentinel group (a master, a replica, three Sentinels): keys and limits
work through a `redis+sentinel://` URL, a master without the Lua scripts gets them again (NOSCRIPT), and the
doctor pings the master the Sentinels name. The failover under load is in tests/faults/test_sentinel_failover.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as redis_asyncio
from pydantic import SecretStr

from gateway.auth import KeyLimits, KeyStore
from gateway.doctor.runner import DoctorConfig, run_checks
from gateway.errors import RateLimitError
from gateway.ratelimit import RedisRateLimiter
from gateway.redis import close_redis, connect_redis
from gateway.settings import AuthSettings, Settings
from tests.redis_sentinel import SentinelGroup

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelGroup]:
    started = SentinelGroup(tmp_path_factory.mktemp("sentinel"))
    try:
        started.start()
        yield started
    finally:
        started.stop()


@pytest.fixture
def settings(group: SentinelGroup) -> Settings:
    return Settings(redis_url=SecretStr(group.url), auth=AuthSettings(secret=SecretStr("sentinel-pepper")))


@pytest.fixture
async def client(settings: Settings) -> AsyncIterator[redis_asyncio.Redis]:
    connection = connect_redis(settings)
    yield connection
    await close_redis(connection)


@pytest.fixture
async def limiter(client: redis_asyncio.Redis, settings: Settings) -> AsyncIterator[RedisRateLimiter]:
    made = RedisRateLimiter(client, settings)
    yield made
    # Before the client closes, as the gateway stops them: a release Redis did not confirm (NOSCRIPT below) is
    # done again in the background, on the client.
    await made.stop()


async def test_keys_and_limits_work_through_the_sentinels(
    group: SentinelGroup, settings: Settings, client: redis_asyncio.Redis, limiter: RedisRateLimiter
) -> None:
    store = KeyStore(client, settings)
    record, secret = await store.create("through-sentinel", KeyLimits(0, 0, 1))
    assert (await store.authenticate(secret)).name == "through-sentinel"
    with group.master_client() as master:  # written on the master the Sentinels name
        assert master.dbsize() > 0
    lease = await limiter.acquire(record, 0)
    with pytest.raises(RateLimitError):
        await limiter.acquire(record, 0)
    await limiter.release(lease)


async def test_a_master_without_the_scripts_gets_them_again(
    group: SentinelGroup, settings: Settings, client: redis_asyncio.Redis, limiter: RedisRateLimiter
) -> None:
    store = KeyStore(client, settings)
    record, _ = await store.create("noscript", KeyLimits(0, 0, 1))
    await limiter.release(await limiter.acquire(record, 0))  # the scripts are in the master's cache now
    with group.master_client() as master:
        master.script_flush()  # as on a promoted replica that never ran them
    lease = await limiter.acquire(record, 0)  # EVALSHA answers NOSCRIPT: loaded, run once
    with pytest.raises(RateLimitError):
        await limiter.acquire(record, 0)  # ...and it ran exactly once: the one slot is taken
    await limiter.release(lease)


def test_the_doctor_pings_the_master_and_masks_the_password(group: SentinelGroup, tmp_path: Path) -> None:
    config = DoctorConfig(redis_url=group.url, cpu=True, environ={"HF_HUB_CACHE": str(tmp_path)})
    (row,) = [check for check in run_checks(config) if check.name == "Redis"]
    assert row.status == "pass", row
    with_password = group.url.replace("://", "://:hunter2@")
    (row,) = [check for check in run_checks(DoctorConfig(redis_url=with_password, cpu=True)) if check.name == "Redis"]
    assert "hunter2" not in str(row) and "redis+sentinel://:***@127.0.0.1:" in row.measured, row
