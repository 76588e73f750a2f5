"""RedisCalls, the one boundary around Redis calls: one deadline, one retry after a connection error, one mapping;
and connect_redis, the one factory (plain or Sentinel)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import hiredis
import pytest
from pydantic import SecretStr
from redis._parsers import Encoder
from redis.asyncio.sentinel import MasterNotFoundError, SentinelConnectionPool
from redis.connection import PythonRespSerializer
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import DataError, InvalidResponse, NoScriptError, ReadOnlyError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.errors import KeyStoreUnavailableError
from gateway.redis import (
    INCOMPLETE,
    RedisCalls,
    close_redis,
    connect_redis,
    pack_command,
    ping_redis,
    reply_reader,
)
from gateway.settings import RedisSettings, Settings

pytestmark = pytest.mark.timeout(10)


def _calls(timeout: float = 1.0) -> RedisCalls:
    return RedisCalls(RedisSettings(command_timeout=timeout))


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


async def test_readonly_is_retried_once() -> None:
    # A replica refuses a write before running it (a failover behind a plain URL): safe to send again.
    work, runs = _work(ReadOnlyError("You can't write against a read only replica."), "ok")
    assert await _calls()(work) == "ok"
    assert runs == [2]


async def test_a_sentinel_url_gets_a_sentinel_managed_pool_with_the_settings_timeouts() -> None:
    settings = Settings(
        redis_url=SecretStr("redis+sentinel://app:s%40cret@10.0.0.1:26379,10.0.0.2,[::1]:26380/cache/2"),
        redis=RedisSettings(connect_timeout=0.3, socket_timeout=0.4, sentinel_password=SecretStr("sentinel-pw")),
    )
    client = connect_redis(settings)
    try:
        pool = client.connection_pool
        assert isinstance(pool, SentinelConnectionPool)
        assert pool.service_name == "cache" and pool.is_master
        kwargs = pool.connection_kwargs
        assert (kwargs["db"], kwargs["username"], kwargs["password"]) == (2, "app", "s@cret")
        assert (kwargs["socket_connect_timeout"], kwargs["socket_timeout"]) == (0.3, 0.4)
        sentinels = pool.sentinel_manager.sentinels
        addresses = [
            (s.connection_pool.connection_kwargs["host"], s.connection_pool.connection_kwargs["port"])
            for s in sentinels
        ]
        assert addresses == [("10.0.0.1", 26379), ("10.0.0.2", 26379), ("::1", 26380)]
        first = sentinels[0].get_connection_kwargs()
        assert first["password"] == "sentinel-pw" and first["socket_timeout"] == 0.4
        # A dead Sentinel costs one refused connection, not redis-py's default ten retries with backoff.
        assert sentinels[0].get_retry().get_retries() == 0  # type: ignore[union-attr]  # set above
    finally:
        await close_redis(client)


async def test_no_master_known_is_a_503() -> None:
    # Every Sentinel refuses: redis-py's MasterNotFoundError is a connection error, retried once, then mapped.
    client = connect_redis(Settings(redis_url=SecretStr("redis+sentinel://127.0.0.1:1,127.0.0.1:9/mymaster")))
    try:
        with pytest.raises(KeyStoreUnavailableError) as caught:
            await _calls()(client.ping)
        assert isinstance(caught.value.__cause__, MasterNotFoundError)
        assert await ping_redis(Settings(redis_url=SecretStr("redis+sentinel://127.0.0.1:1/mymaster"))) is not None
    finally:
        await close_redis(client)


class _KeyName(str):
    """A str subclass (as a str-based enum is): packed by its text, as redis-py does."""


class _Count(int):
    """An int subclass: packed by its `repr`, as redis-py does."""


@pytest.mark.parametrize(
    "args",
    [
        ("EVALSHA", "0" * 40, 2, "nemotron:rl:{alice}:r", b"raw\r\nbytes", 0, -17, 2**53, 1.5, "", "é"),
        ("EVALSHA", "f" * 40, 0),
        ("EVALSHA", "f" * 40, 1, _KeyName("nemotron:rl:{bob}:r"), _Count(7), -0.0, 1e300),
    ],
)
def test_a_packed_script_call_is_the_bytes_redis_py_sends(args: tuple[object, ...]) -> None:
    # redis-py's own encoding in Python (with hiredis installed its connections pack with hiredis, which refuses
    # int subclasses: an IntEnum's `repr` is not its value)
    python_packing = PythonRespSerializer(6000, Encoder("utf-8", "strict", decode_responses=False).encode)
    assert pack_command(*args) == b"".join(python_packing.pack(*args))  # type: ignore[arg-type]  # the values above


@pytest.mark.parametrize("value", [True, None, object()])
def test_what_redis_py_refuses_to_encode_is_refused(value: object) -> None:
    with pytest.raises(DataError):
        pack_command("EVALSHA", "0" * 40, 0, value)


# What the script lane reads: every RESP2 and RESP3 reply kind hiredis reads, as redis-py (reading with it) gives it.
_REPLIES: list[tuple[bytes, object]] = [
    (b":42\r\n", 42),
    (b":-7\r\n", -7),
    (b"$5\r\nhello\r\n", b"hello"),
    (b"$0\r\n\r\n", b""),
    (b"$-1\r\n", None),
    (b"_\r\n", None),
    (b"+OK\r\n", b"OK"),
    (b"#t\r\n", True),
    (b"#f\r\n", False),
    (b",1.5\r\n", 1.5),
    (b"=7\r\ntxt:abc\r\n", b"abc"),
    (b"*3\r\n:1\r\n$-1\r\n$1\r\nx\r\n", [1, None, b"x"]),
    (b"*-1\r\n", None),
    (b"*0\r\n", []),
    (b"*2\r\n*1\r\n:1\r\n*0\r\n", [[1], []]),
    (b"~2\r\n:1\r\n:2\r\n", [1, 2]),
    (b"%1\r\n$1\r\nk\r\n:9\r\n", {b"k": 9}),
]


def _read_all(*pieces: bytes) -> list[object]:
    reader, replies = reply_reader(), []
    for piece in pieces:
        reader.feed(piece)
        while (reply := reader.gets()) is not INCOMPLETE:
            replies.append(reply)
    return replies


@pytest.mark.parametrize(("wire", "value"), _REPLIES)
def test_a_reply_reads_as_redis_py_gives_it_however_it_is_split(wire: bytes, value: object) -> None:
    assert _read_all(wire + b":0\r\n") == [value, 0]  # and stops where the reply ends
    for cut in range(len(wire)):  # however the reply is split across reads: nothing until all of it came
        assert _read_all(wire[:cut]) == []
        assert _read_all(wire[:cut], wire[cut:]) == [value]


def test_a_push_is_told_apart_from_replies() -> None:
    push, reply = _read_all(b">2\r\n$10\r\ninvalidate\r\n*0\r\n:1\r\n")
    assert type(push) is hiredis.PushNotification and reply == 1


def test_an_error_reply_is_redis_pys_exception_for_it_returned_not_raised() -> None:
    noscript, readonly, nested = _read_all(
        b"-NOSCRIPT No matching script. Please use EVAL.\r\n",
        b"-READONLY You can't write against a read only replica.\r\n",
        b"*2\r\n:1\r\n-ERR inner\r\n",
    )
    assert isinstance(noscript, NoScriptError)
    assert isinstance(readonly, ReadOnlyError)
    assert isinstance(nested, list) and nested[0] == 1 and isinstance(nested[1], ResponseError)
    assert str(nested[1]) == "inner"  # as redis-py: the code apart


@pytest.mark.parametrize("wire", [b"?what\r\n", b":notanumber\r\n", b"$abc\r\n"])
def test_what_is_not_resp_is_refused(wire: bytes) -> None:
    with pytest.raises(InvalidResponse):
        _read_all(wire)
