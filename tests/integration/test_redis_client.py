"""connect_redis and DirectScript against a real Redis: a command is written in the caller's task (no task of its
own per command), the connection classes of every URL kind keep their own behaviour under the inline write, and a
script call on the client's script lane answers as redis-py's own: after a script flush, in a pipeline, with an
error; pipelined calls each get their own reply, an abandoned one included, and those of one turn of the loop go out
in one write; a stalled or closed connection is
replaced; closing the client closes the lane's connection at once."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import time
import warnings
from collections.abc import AsyncIterator, Coroutine, Generator
from typing import Any

import pytest
import redis
import redis.asyncio as redis_asyncio
from pydantic import SecretStr
from redis.asyncio.connection import SSLConnection, UnixDomainSocketConnection
from redis.asyncio.sentinel import SentinelManagedConnection
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.redis import DirectScript, close_redis, connect_redis, script_lane
from gateway.settings import RedisSettings, Settings
from tests.procs import async_wait_until

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


_ECHO = "return {ARGV[1], redis.call('INCR', KEYS[1])}"


async def test_pipelined_calls_each_get_their_own_reply_an_abandoned_one_included(redis_clean: str) -> None:
    client = connect_redis(Settings(redis_url=SecretStr(redis_clean)))
    echo = DirectScript(client, _ECHO)
    try:
        await echo(keys=["n"], args=["warm"])
        abandoned = asyncio.create_task(echo(keys=["n"], args=["abandoned"]))
        await asyncio.sleep(0)  # written, its reply not read yet
        abandoned.cancel()
        replies = await asyncio.gather(*(echo(keys=["n"], args=[f"call-{i}"]) for i in range(300)))
        assert [reply[0] for reply in replies] == [f"call-{i}".encode() for i in range(300)]
        assert sorted(reply[1] for reply in replies) == list(range(3, 303))  # the abandoned call ran too (2)
        with contextlib.suppress(asyncio.CancelledError):
            await abandoned
    finally:
        await close_redis(client)


class _CountingTransport:
    """A transport that counts its writes and passes everything on."""

    def __init__(self, transport: Any) -> None:
        self._transport = transport
        self.writes = 0

    def write(self, data: bytes) -> None:
        self.writes += 1
        self._transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


async def test_the_calls_of_one_turn_of_the_loop_go_out_in_one_write(redis_clean: str) -> None:
    client = connect_redis(Settings(redis_url=SecretStr(redis_clean)))
    echo = DirectScript(client, _ECHO)
    try:
        await echo(keys=["n"], args=["warm"])  # connected, the script loaded
        lane = script_lane(client)
        counting = lane._transport = _CountingTransport(lane._transport)
        replies = await asyncio.gather(*(echo(keys=["n"], args=[f"call-{i}"]) for i in range(40)))
        assert [reply[0] for reply in replies] == [f"call-{i}".encode() for i in range(40)]
        assert counting.writes == 1  # one wake-up of Redis for the 40, not 40
        assert await echo(keys=["n"], args=["alone"]) == [b"alone", 42]
        assert counting.writes == 2
    finally:
        await close_redis(client)


class _HoldingProxy:
    """A TCP proxy to Redis that, while `holding`, keeps what clients send (Redis frozen, from the client's side)."""

    def __init__(self, target: str) -> None:
        host_port = target.split("//", 1)[1].split("/", 1)[0]
        self._host, port = host_port.rsplit(":", 1)
        self._port = int(port)
        self.holding = False
        self.connections = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        up_reader, up_writer = await asyncio.open_connection(self._host, self._port)

        async def downstream() -> None:
            with contextlib.suppress(ConnectionError):
                while data := await up_reader.read(65536):
                    writer.write(data)

        pump = asyncio.create_task(downstream())
        try:
            while data := await reader.read(65536):
                if not self.holding:
                    up_writer.write(data)
        except ConnectionError:
            pass
        finally:
            pump.cancel()
            writer.close()
            up_writer.close()


@pytest.fixture
async def holding_proxy(redis_clean: str) -> AsyncIterator[tuple[_HoldingProxy, str]]:
    proxy = _HoldingProxy(redis_clean)
    port = await proxy.start()
    db = redis_clean.rsplit("/", 1)[1]
    yield proxy, f"redis://127.0.0.1:{port}/{db}"
    await proxy.stop()


async def test_a_stalled_connection_is_dropped_and_the_next_call_gets_its_own_reply(
    holding_proxy: tuple[_HoldingProxy, str],
) -> None:
    proxy, url = holding_proxy
    # Every other deadline past the test's own timeout: only socket_timeout can end the held call.
    patient = RedisSettings(socket_timeout=0.2, connect_timeout=60.0, command_timeout=60.0)
    client = connect_redis(Settings(redis_url=SecretStr(url), redis=patient))
    echo = DirectScript(client, _ECHO)
    try:
        assert (await echo(keys=["n"], args=["before"]))[0] == b"before"
        connections = proxy.connections  # the lane's (and the pool's, had the script to be loaded)
        proxy.holding = True
        # As a read of redis-py's: a command unanswered within socket_timeout is its TimeoutError (not retried).
        with pytest.raises(RedisTimeoutError):
            await echo(keys=["n"], args=["held"])
        proxy.holding = False
        # The held call's connection was dropped: the next one does not queue behind it, and gets its own reply.
        assert (await echo(keys=["n"], args=["after"]))[0] == b"after"
        assert proxy.connections == connections + 1
    finally:
        await close_redis(client)


def _named_connections(url: str, name: str) -> list[dict[str, Any]]:
    probe = redis.Redis.from_url(url, socket_timeout=5.0)
    try:
        return [entry for entry in probe.client_list() if entry.get("name") == name]
    finally:
        probe.close()


async def test_a_connection_the_server_closed_is_replaced_and_closing_the_client_closes_it_at_once(
    redis_clean: str,
) -> None:
    name = f"lane-{os.getpid()}-{time.monotonic_ns()}"
    # Deadlines past the test's own timeout: a close that waited for one could not end before the test is stopped.
    patient = RedisSettings(socket_timeout=60.0, connect_timeout=60.0, command_timeout=60.0)
    client = connect_redis(Settings(redis_url=SecretStr(f"{redis_clean}?client_name={name}"), redis=patient))
    echo = DirectScript(client, _ECHO)
    killer: redis_asyncio.Redis = redis_asyncio.Redis.from_url(redis_clean)
    try:
        assert (await echo(keys=["n"], args=["first"]))[0] == b"first"
        (lane,) = _named_connections(redis_clean, name)
        await killer.client_kill_filter(_id=lane["id"])
        await asyncio.sleep(0.1)  # the lane sees the end
        assert (await echo(keys=["n"], args=["second"]))[0] == b"second"
        (replacement,) = _named_connections(redis_clean, name)
        assert replacement["id"] != lane["id"]
        await client.aclose()
        await async_wait_until(lambda: _named_connections(redis_clean, name) == [], within=10)
    finally:
        await killer.aclose()
        await close_redis(client)


async def test_closing_the_client_while_its_lane_connects_fails_the_call_and_leaves_no_connection_open(
    holding_proxy: tuple[_HoldingProxy, str],
) -> None:
    # The handshake held (Redis frozen after accepting): the lane's connection is open and waits for a reply when the
    # client is closed, as at a gateway's shutdown.
    proxy, url = holding_proxy
    proxy.holding = True
    client = connect_redis(Settings(redis_url=SecretStr(url), redis=RedisSettings(socket_timeout=5.0)))
    call = asyncio.create_task(DirectScript(client, _ECHO)(keys=["n"], args=["held"]))
    await async_wait_until(lambda: proxy.connections == 1, within=5)
    await asyncio.sleep(0.05)
    await close_redis(client)
    # A connection error, as any call on a closed client: not a cancel of the caller's task.
    with pytest.raises(redis.ConnectionError):
        await asyncio.wait_for(call, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gc.collect()
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []
