"""connect_redis against a real Redis: a command is written in the caller's task (no task of its own per command),
and the connection classes of every URL kind keep their own behaviour under the inline write."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Generator
from typing import Any

import pytest
from pydantic import SecretStr
from redis.asyncio.connection import SSLConnection, UnixDomainSocketConnection
from redis.asyncio.sentinel import SentinelManagedConnection

from gateway.redis_client import close_redis, connect_redis
from gateway.settings import Settings

pytestmark = pytest.mark.timeout(15)


async def test_commands_create_no_task_each(redis_clean: str) -> None:
    # redis-py's write under socket_timeout runs in a task of its own (asyncio.wait_for): one per command.
    client = connect_redis(Settings(redis_url=SecretStr(redis_clean)))
    loop = asyncio.get_running_loop()
    created = [0]
    default = loop.get_task_factory()

    def counting(
        loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any] | Generator[Any, None, Any]
    ) -> asyncio.Future[Any]:
        created[0] += 1
        return default(loop, coro) if default is not None else asyncio.Task(coro, loop=loop)

    try:
        await client.set("inline-write", "1")  # the connection is made (its handshake may use tasks)
        loop.set_task_factory(counting)
        for _ in range(50):
            assert await client.get("inline-write") == b"1"
        loop.set_task_factory(default)
        assert created == [0]
    finally:
        loop.set_task_factory(default)
        await close_redis(client)


@pytest.mark.parametrize(
    ("url", "base"),
    [
        ("rediss://127.0.0.1:1/0", SSLConnection),
        ("unix:///tmp/nowhere.sock", UnixDomainSocketConnection),
        ("redis+sentinel://127.0.0.1:1/mymaster/0", SentinelManagedConnection),
    ],
)
async def test_every_url_kind_keeps_its_connection_class(url: str, base: type) -> None:
    client = connect_redis(Settings(redis_url=SecretStr(url)))
    try:
        assert issubclass(client.connection_pool.connection_class, base)
    finally:
        await close_redis(client)
