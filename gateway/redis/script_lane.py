"""The script lane: every Lua script call of a Redis client pipelined on one connection of its own.

Lua scripts, the gateway's hot path (a key's admission and release on every request), do not take a pooled
connection each: every client has one `ScriptLane`, a connection of its own that carries every script call
pipelined, its replies matched to the calls in order (the server answers in order), packed and read by hiredis.
redis-py's pool makes and authenticates that connection (TLS, Unix sockets, Sentinel's master lookup alike); the
lane then owns its transport. `DirectScript` is redis-py's script object called on the lane; `inline_writes` makes
a client's pooled connections write a command in the caller's task.

This reaches into redis-py below its documented API: each name it relies on is declared in `gateway.redis.internals`
and checked against the installed redis-py by tests/unit/test_library_internals.py. Imports redis-py and hiredis only.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final, cast

import hiredis
import redis.asyncio as redis_asyncio
from redis._parsers.base import BaseParser
from redis.asyncio.connection import AbstractConnection
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import DataError, InvalidResponse, NoScriptError, ReadOnlyError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError


class InlineWrite(AbstractConnection):
    """A redis-py connection that writes a command in the caller's task when the write cannot wait.

    redis-py bounds every write by `socket_timeout` with `asyncio.wait_for`, which runs it in a task of its own:
    a task, its scheduling and one more event-loop turn per command (with keys and limits on, that was a tenth of
    the gateway's CPU per request, py-spy under the overhead benchmark). A write to a connected transport with
    nothing buffered goes straight into the kernel's buffer and cannot time out, so it is done here; anything
    else (not connected, a health check due, a closing or backed-up transport) takes redis-py's own path.
    """

    # Set while a ScriptLane owns this connection's transport (the pool counts it as in use): the pool's disconnect
    # (a client's `aclose`) lets the lane close it, at once. redis-py's own would wait for the stream's protocol,
    # which the lane replaced, to see the end.
    lane_release: Callable[[], None] | None = None

    async def disconnect(self, *args: Any, **kwargs: Any) -> None:
        if self.lane_release is not None:
            self.lane_release()
            return
        await super().disconnect(*args, **kwargs)

    async def send_packed_command(self, command: str | bytes | Iterable[bytes], check_health: bool = True) -> None:
        writer = self._writer
        health_due = self.health_check_interval and asyncio.get_running_loop().time() > self.next_health_check
        if (
            writer is None
            or self._reader is None
            or writer.transport.is_closing()
            or writer.transport.get_write_buffer_size()
            or (check_health and health_due)
        ):
            await super().send_packed_command(command, check_health)
            return
        if isinstance(command, str):
            command = command.encode()
        try:
            writer.writelines([command] if isinstance(command, bytes) else command)
        except BaseException as exc:  # as redis-py: a connection whose write failed is not used again
            await self.disconnect(nowait=True)
            if isinstance(exc, OSError):
                raise RedisConnectionError(f"Error while writing to socket: {exc}") from exc
            raise


_INLINE_CLASSES: dict[type[AbstractConnection], type[AbstractConnection]] = {}


def inline_writes(client: redis_asyncio.Redis) -> redis_asyncio.Redis:
    """`client` whose pool makes its connections of its own class (plain, TLS, Unix socket, Sentinel-managed)
    with `InlineWrite` in front."""
    pool = client.connection_pool
    base = pool.connection_class
    if not issubclass(base, InlineWrite):
        derived = _INLINE_CLASSES.get(base)
        if derived is None:
            derived = _INLINE_CLASSES[base] = type(f"Inline{base.__name__}", (InlineWrite, base), {})
        pool.connection_class = derived
    return client


class DirectScript(AsyncScript):
    """redis-py's Lua script, called by SHA on its client's `ScriptLane`.

    redis-py's path for one call goes through `evalsha`, `execute_command`, its retry wrapper (no retries here),
    its response callbacks and its per-command observability hooks, each awaited, then the pool's checkout and
    release (a lock, a check of the socket, more hooks): with keys and limits on, a third of the gateway's CPU per
    request (py-spy under the overhead benchmark). The lane does what matters as before: a connection error or a
    stalled connection is dropped, READONLY from a demoted master drops it too, NOSCRIPT loads the script and sends
    it again. Called with a pipeline (`client=`), it is redis-py's own.
    """

    def __init__(self, registered_client: redis_asyncio.Redis, script: str) -> None:
        super().__init__(registered_client, script)
        self._client = registered_client
        self._loading: asyncio.Future[Any] | None = None
        # The lane's connection this script last ran on (so Redis has it): `post` sends it there, not elsewhere.
        self._ran_on: object | None = None

    async def __call__(
        self,
        keys: Sequence[Any] | None = None,
        args: Iterable[Any] | None = None,
        client: Any = None,
    ) -> Any:
        if client is not None and client is not self._client:
            return await super().__call__(keys, args, client)
        keys, args = list(keys or ()), list(args or ())
        lane = script_lane(self._client)
        command = pack_command("EVALSHA", self.sha, len(keys), *keys, *args)
        try:
            reply = await lane.call(command)
        except NoScriptError:  # a Redis that lost its scripts (a restart, a promoted replica)
            await self._load(lane)
            reply = await lane.call(command)
        self._ran_on = lane.connection
        return reply

    def post(
        self, keys: Sequence[Any], args: Iterable[Any], on_reply: Callable[[Any], None]
    ) -> asyncio.Future[None] | None:
        """The call queued on the lane without waiting (`ScriptLane.post`): `on_reply` gets its reply; the future
        returned is done once it is written. None, and nothing sent, unless the script already ran on the lane's
        connection: a NOSCRIPT there (a new connection may reach a restarted or promoted Redis) would let the calls
        queued behind it run first; `__call__` loads the script and sends it again."""
        lane = script_lane(self._client)
        if self._ran_on is None or self._ran_on is not lane.connection:
            return None
        keys = list(keys)
        return lane.post(pack_command("EVALSHA", self.sha, len(keys), *keys, *args), on_reply)

    async def _load(self, lane: ScriptLane) -> None:
        """SCRIPT LOAD on the lane, once for all the calls that met NOSCRIPT together (a burst at a fresh or restarted
        Redis: each loading it through the pool grew the pool by one connection a call)."""
        loading = self._loading
        if loading is None or loading.done():
            loading = self._loading = asyncio.ensure_future(lane.call(pack_command("SCRIPT", "LOAD", self.script)))
            loading.add_done_callback(_retrieve)
        await asyncio.shield(loading)  # its SHA is ours: the SHA-1 of the script


# What `reply_reader`'s `gets` returns while the reply it reads has not all arrived.
INCOMPLETE: Final = object()


def reply_reader() -> hiredis.Reader:
    """A reader of one connection's replies, as redis-py gives them undecoded (redis-py reads with hiredis too):
    `feed` it what arrives; `gets` returns each whole reply in turn (integers as int, strings as bytes, nil as None,
    arrays and sets as lists, maps as dicts, an error reply as redis-py's exception for it, not raised; a RESP3
    push as a `hiredis.PushNotification`), then `INCOMPLETE`, and raises InvalidResponse for what is not RESP."""
    return hiredis.Reader(protocolError=InvalidResponse, replyError=_error, notEnoughData=INCOMPLETE)


def _error(text: str) -> RedisError:
    """redis-py's exception for an error reply's text."""
    error: RedisError = BaseParser.parse_error(text)  # type: ignore[no-untyped-call]
    return error


class _LaneProtocol(asyncio.Protocol):
    """The lane's transport's protocol: what arrives goes to the lane, as does the end."""

    def __init__(self, lane: ScriptLane) -> None:
        self._lane = lane

    def data_received(self, data: bytes) -> None:
        self._lane.received(self, data)

    def connection_lost(self, exc: Exception | None) -> None:
        self._lane.lost(self, exc)


# A call waiting for its reply: the future its caller awaits, or (a posted call) the function that takes the reply;
# and when it was sent.
_Pending = tuple[asyncio.Future[Any] | None, Callable[[Any], None] | None, float]


class ScriptLane:
    """One connection that carries every script call of a client, pipelined.

    A call queues its command and waits for the reply in the order it was sent: no pool checkout, no lock, no task;
    the commands queued in one turn of the event loop go out in one write at its end.
    The first call (and the first after a loss) connects, the calls arriving meanwhile wait for that one connection.
    A call abandoned by its caller (its deadline, a client gone) keeps its place, so its reply is read and dropped.
    The connection is dropped, and the calls still waiting fail with a connection error (callers retry once, the
    scripts being idempotent), when the server closes it, when a reply is not RESP, or when READONLY says the server
    is no longer the master. A call unanswered after `stall_after` seconds (redis-py's `socket_timeout`: a frozen
    or unreachable server) fails with redis-py's TimeoutError, as a read of redis-py's would, and the connection is
    dropped with it, so the next call reconnects instead of queueing behind it. One timer watches the oldest call
    (armed for its deadline, moved on to the next oldest only when it fires), not one timer per call.
    """

    def __init__(self, pool: Any, stall_after: float) -> None:
        self._pool = pool
        self._stall_after = stall_after
        self._transport: asyncio.WriteTransport | None = None
        self._connection: InlineWrite | None = None  # redis-py's, which made the transport
        self._protocol: _LaneProtocol | None = None
        self._connecting: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: deque[_Pending] = deque()
        self._reader = reply_reader()  # the current connection's
        self._stall_timer: asyncio.TimerHandle | None = None
        self._unsent: list[bytes] = []  # commands of this turn of the loop, written together at its end
        self._written: list[asyncio.Future[None]] = []  # `post`'s, done once those commands are written

    async def call(self, command: bytes) -> Any:
        """Send one packed command and return its reply; an error reply is raised as redis-py's exception."""
        loop = asyncio.get_running_loop()
        if loop is self._loop and self._stalled(loop.time()):
            self._check_stall(loop)  # overdue, and the timer has not run yet (a busy loop)
        transport = self._transport
        if transport is None or loop is not self._loop or transport.is_closing():
            await self._connected(loop)
        reply: asyncio.Future[Any] = loop.create_future()
        self._queue(loop, command, reply, None)
        return await reply

    @property
    def connection(self) -> object | None:
        """The current connection, as an identity to compare with a later one (None: not connected)."""
        return self._protocol

    def post(self, command: bytes, on_reply: Callable[[Any], None]) -> asyncio.Future[None] | None:
        """Queue one packed command without waiting for anything: `on_reply` is called with its reply (an error
        reply, or the connection's loss, as the exception; it must not raise), in the data callback: no future, no
        callback scheduled, per reply. Returns a future done once the command is written (with the rest of this
        turn's commands; or failed, its reply then failing too). None, and nothing queued, when the lane has no
        usable connection: `call` makes one.

        What the caller writes anywhere after that future is done reaches its peer after the command reached Redis:
        for a release that must precede the answer, without waiting for Redis's reply."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            return None
        if self._stalled(loop.time()):
            self._check_stall(loop)
        transport = self._transport
        if transport is None or transport.is_closing():
            return None
        self._queue(loop, command, None, on_reply)
        # One per caller: a caller cancelled while waiting cancels its own, not the others'.
        written: asyncio.Future[None] = loop.create_future()
        self._written.append(written)
        return written

    def _queue(
        self,
        loop: asyncio.AbstractEventLoop,
        command: bytes,
        future: asyncio.Future[Any] | None,
        on_reply: Callable[[Any], None] | None,
    ) -> None:
        self._pending.append((future, on_reply, loop.time()))
        if self._stall_timer is None:
            self._watch_oldest(loop)
        # Written at the end of this turn of the loop, with every other call made in it: one write, one wake-up of
        # Redis, for all the requests that reached their admission together.
        if not self._unsent:
            loop.call_soon(self._write)
        self._unsent.append(command)

    def _write(self) -> None:
        # What is unsent is for the current connection: a drop clears it with the calls it fails.
        unsent, self._unsent = self._unsent, []
        transport = self._transport
        if unsent and transport is not None and not transport.is_closing():
            transport.write(unsent[0] if len(unsent) == 1 else b"".join(unsent))
        self._tell_written()

    def _tell_written(self) -> None:
        if self._written:
            written, self._written = self._written, []
            for future in written:
                if not future.done():
                    future.set_result(None)

    def _stalled(self, now: float) -> bool:
        return bool(self._pending) and now - self._pending[0][2] >= self._stall_after

    def _watch_oldest(self, loop: asyncio.AbstractEventLoop) -> None:
        self._stall_timer = loop.call_at(self._pending[0][2] + self._stall_after, self._check_stall, loop)

    def _check_stall(self, loop: asyncio.AbstractEventLoop) -> None:
        # Run by the timer, or early by a call (the timer not run yet): either way that timer is done with.
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None
        if not self._pending:
            return
        now = loop.time()
        if self._stalled(now):
            self._drop(
                RedisConnectionError("Redis stopped answering on this connection; reconnecting"),
                overdue=RedisTimeoutError(f"Redis did not answer within {self._stall_after:g} s"),
                sent_before=now - self._stall_after,
            )
        else:  # the oldest then was answered: watch the oldest now
            self._watch_oldest(loop)

    async def _connected(self, loop: asyncio.AbstractEventLoop) -> asyncio.WriteTransport:
        connecting = self._connecting
        if connecting is None or connecting.done() or loop is not self._loop:
            if self._transport is not None:  # closing, or made on another event loop
                self._drop(RedisConnectionError("Connection to Redis replaced"))
            self._loop = loop
            connecting = self._connecting = loop.create_task(self._connect())
            connecting.add_done_callback(_retrieve)
        await asyncio.shield(connecting)  # a caller leaving does not abandon the others' connection
        if self._transport is None:
            raise RedisConnectionError("Connection to Redis lost")
        return self._transport

    async def _connect(self) -> None:
        connection: InlineWrite = self._pool.make_connection()
        # The pool counts the lane's connection as in use from the start, so closing the client (`aclose`,
        # `close_redis`) closes it too: during the handshake by redis-py's own disconnect (the handshake then fails
        # with a connection error), after it by the lane (`InlineWrite.disconnect`). redis-py's connection object
        # keeps its stream meanwhile (a StreamWriter closes its transport when collected).
        self._pool._in_use_connections.add(connection)
        try:
            # The handshake (AUTH, SELECT, CLIENT SETINFO; with Sentinel, the master lookup), within connect_timeout.
            await connection.connect()  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
            writer = connection._writer
            if writer is None:
                raise RedisConnectionError("Connection to Redis lost")
        except BaseException:
            # redis-py closes a connection whose handshake failed, not one cancelled during it (a closing loop).
            self._release(connection)
            raise
        transport = writer.transport
        protocol = _LaneProtocol(self)
        transport.set_protocol(protocol)
        connection.lane_release = self.close
        self._reader = reply_reader()
        self._transport, self._connection, self._protocol = transport, connection, protocol

    def received(self, protocol: _LaneProtocol, data: bytes) -> None:
        """Replies arrived on the connection of `protocol`: settle the calls they answer, in order."""
        if protocol is not self._protocol:
            return
        reader = self._reader
        reader.feed(data)
        try:
            while (reply := reader.gets()) is not INCOMPLETE:
                if type(reply) is hiredis.PushNotification:
                    continue
                if not self._pending:
                    raise InvalidResponse("Redis sent a reply no call was waiting for")
                future, on_reply, _ = self._pending.popleft()
                if on_reply is not None:
                    on_reply(reply)
                elif future is not None and not future.done():
                    if isinstance(reply, RedisError):
                        future.set_exception(reply)
                    else:
                        future.set_result(reply)
                if isinstance(reply, ReadOnlyError):  # a demoted master: the next call finds the new one
                    self._drop(RedisConnectionError("Redis is no longer the master (READONLY)"))
                    return
        except InvalidResponse as exc:
            self._drop(RedisConnectionError(f"Redis sent what is not a reply: {exc}"))

    def lost(self, protocol: _LaneProtocol, exc: Exception | None) -> None:
        """The connection of `protocol` ended: the calls still waiting fail with a connection error."""
        if protocol is self._protocol:
            self._drop(RedisConnectionError(f"Connection to Redis lost: {exc or 'closed by the server'}"))

    def _drop(self, error: Exception, *, overdue: Exception | None = None, sent_before: float = 0.0) -> None:
        """Close the connection; the calls still waiting fail with `error`, those sent before `sent_before` (the
        overdue ones) with `overdue`."""
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None
        transport, connection = self._transport, self._connection
        self._transport, self._connection, self._protocol = None, None, None
        if transport is not None:
            # What is still buffered for a stalled server goes too. RuntimeError: the loop it was made on is closed.
            with contextlib.suppress(RuntimeError):
                transport.abort()
        if connection is not None:  # after the abort: its StreamWriter, collected, would close the transport
            self._release(connection)
        self._unsent = []
        self._tell_written()  # nothing more to wait for: the calls' replies fail below
        pending, self._pending = self._pending, deque()
        for future, on_reply, sent in pending:
            failure = overdue if overdue is not None and sent <= sent_before else error
            if on_reply is not None:
                on_reply(failure)
            elif future is not None and not future.done():
                future.set_exception(failure)

    def _release(self, connection: InlineWrite) -> None:
        """Give `connection` up: out of the pool's count, its stream closed (a no-op after the transport's abort)."""
        self._pool._in_use_connections.discard(connection)
        connection.lane_release = None
        writer, connection._reader, connection._writer = connection._writer, None, None
        if writer is not None:
            writer.close()

    def close(self) -> None:
        """Close the connection; calls still waiting fail with a connection error."""
        if self._connecting is not None and not self._connecting.done():
            self._connecting.cancel()
        self._drop(RedisConnectionError("The Redis client was closed"))


def _retrieve(task: asyncio.Future[Any]) -> None:
    """Mark a shared task's outcome as seen (every waiter got it)."""
    if not task.cancelled():
        task.exception()


_LANES: weakref.WeakKeyDictionary[redis_asyncio.Redis, ScriptLane] = weakref.WeakKeyDictionary()


def script_lane(client: redis_asyncio.Redis) -> ScriptLane:
    """The `ScriptLane` of `client` (made on first use; closing the client closes its connection)."""
    lane = _LANES.get(client)
    if lane is None:
        pool = inline_writes(client).connection_pool
        lane = _LANES[client] = ScriptLane(pool, pool.connection_kwargs.get("socket_timeout") or 1.0)
    return lane


# hiredis' stub types its argument as a 1-tuple and leaves its return untyped.
_hiredis_pack = cast(Callable[[tuple[object, ...]], bytes], hiredis.pack_command)


def pack_command(*args: object) -> bytes:
    """One Redis command in RESP, in one piece, as redis-py encodes its arguments (bytes as they are, str as UTF-8,
    int and float by `repr`; a bool or anything else is a DataError). hiredis packs the plain types (a script
    call's 20-30 arguments: a third of the CPU Python's own packing took); a subclass (an int enum's `repr` is not
    its value) is encoded here first."""
    try:
        return _hiredis_pack(args)
    except TypeError:
        return _hiredis_pack(tuple(_encode_argument(arg) for arg in args))


def _encode_argument(arg: object) -> bytes:
    if isinstance(arg, bytes):
        return bytes(arg)
    if isinstance(arg, str):
        return str.encode(arg)
    if isinstance(arg, int | float) and not isinstance(arg, bool):
        return repr(arg).encode()
    raise DataError(f"Invalid input of type: '{type(arg).__name__}'. Convert to bytes, str, int or float first.")
