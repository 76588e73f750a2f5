"""RedisCalls, the one boundary around Redis calls: one deadline, one retry after a connection error, one mapping."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from pydantic import SecretStr
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.errors import KeyStoreUnavailableError
from gateway.redis_client import RedisCalls, connect_redis
from gateway.settings import RedisSettings, Settings

pytestmark = pytest.mark.timeout(10)


def _calls(timeout: float = 1.0) -> RedisCalls:
    return RedisCalls(Settings(redis=RedisSettings(command_timeout=timeout)))


def _work(*outcomes: BaseException | str) -> tuple[Callable[[], Awaitable[str]], list[int]]:
    """A call that raises or returns each outcome in turn; and how many times it ran."""
    runs = [0]

    async def work() -> str:
        outcome = outcomes[runs[0]]
        runs[0] += 1
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    return work, runs


async def test_a_connection_error_is_retried_once_on_a_fresh_connection() -> None:
    work, runs = _work(RedisConnectionError("Connection closed by server."), "ok")
    assert await _calls()(work) == "ok"
    assert runs == [2]


async def test_a_second_connection_error_is_a_503_with_the_callers_message() -> None:
    work, runs = _work(RedisConnectionError("refused"), RedisConnectionError("refused"), "never")
    with pytest.raises(KeyStoreUnavailableError) as caught:
        await _calls()(work, unavailable="The rate-limit store is unavailable; retry shortly.")
    assert runs == [2]
    assert caught.value.status_code == 503
    assert caught.value.message == "The rate-limit store is unavailable; retry shortly."
    assert isinstance(caught.value.__cause__, RedisConnectionError)


@pytest.mark.parametrize("error", [RedisTimeoutError("Timeout reading"), ResponseError("NOSCRIPT"), OSError(9, "x")])
async def test_other_errors_are_not_retried(error: Exception) -> None:
    # A timeout may mean the command is still running in Redis; it is never sent twice by us.
    work, runs = _work(error, "never")
    with pytest.raises(KeyStoreUnavailableError):
        await _calls()(work)
    assert runs == [1]


async def test_the_deadline_bounds_the_call_and_its_retry() -> None:
    async def hangs() -> None:
        await asyncio.Event().wait()

    with pytest.raises(KeyStoreUnavailableError) as caught:
        await _calls(timeout=0.05)(hangs)
    assert isinstance(caught.value.__cause__, TimeoutError)


async def test_the_client_checks_pooled_connections_before_use() -> None:
    # redis-py skips its dead-connection check at checkout while maintenance notifications are on.
    client = connect_redis(Settings(redis_url=SecretStr("redis://127.0.0.1:1/0")))
    try:
        assert not client.connection_pool.maint_notifications_enabled()
    finally:
        await client.aclose()
