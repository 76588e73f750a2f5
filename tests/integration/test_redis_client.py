"""connect_redis and DirectScript against a real Redis: a command is written in the caller's task (no task of its
own per command), the connection classes of every URL kind keep their own behaviour under the inline write, and a
script call straight on a pooled connection answers as redis-py's own: after a script flush, in a pipeline, with
an error."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Generator
from typing import Any

import pytest
from pydantic import SecretStr
from redis.asyncio.connection import SSLConnection, UnixDomainSocketConnection
from redis.asyncio.sentinel import SentinelManagedConnection
from redis.exceptions import ResponseError

from gateway.redis_client import DirectScript, close_redis, connect_redis
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


_SCRIPT = "redis.call('SET', KEYS[1], ARGV[1]); return {redis.call('INCR', KEYS[2]), ARGV[2]}"


async def test_a_direct_script_answers_as_redis_pys_own(redis_clean: str) -> None:
    client = connect_redis(Settings(redis_url=SecretStr(redis_clean)))
    try:
        direct, theirs = DirectScript(client, _SCRIPT), client.register_script(_SCRIPT)
        assert await direct(keys=["a", "n"], args=["x", 7]) == [1, b"7"]
        assert await theirs(keys=["a", "n"], args=["x", 7]) == [2, b"7"]
        await client.script_flush()  # a restarted Redis, or a promoted replica, without the script
        assert await direct(keys=["a", "n"], args=["y", 8]) == [3, b"8"]
        assert await client.get("a") == b"y"
        async with client.pipeline(transaction=False) as pipe:
            await direct(keys=["a", "n"], args=["z", 9], client=pipe)
            assert await pipe.execute() == [[4, b"9"]]
        failing = DirectScript(client, "return redis.error_reply('NOPE refused')")
        with pytest.raises(ResponseError, match="NOPE refused"):
            await failing()
        assert await direct(keys=["a", "n"], args=["w", 1]) == [5, b"1"]  # the connection serves on after an error
    finally:
        await close_redis(client)
