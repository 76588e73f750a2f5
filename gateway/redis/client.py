"""The Redis boundary's client side: the client factory, the error map, the call boundary and the pub/sub listener.

Imports settings, errors, metrics, background, deadline and the package's script lane. `connect_redis` is the one
factory of clients (the gateway, the `keys` CLI, the doctor): a `redis://` URL gets a plain pool, a
`redis+sentinel://` URL redis-py's Sentinel client, whose pool asks the Sentinels for the master before each new
connection, so a failover is followed by reconnecting; a connection still on a demoted master gets READONLY, which
redis-py turns into a connection error. Lua scripts are sent by SHA on the client's script lane and loaded again on
NOSCRIPT (a promoted replica may lack them). Every Redis call of the services and routes goes through `RedisCalls`,
which bounds it by one deadline (`redis.command_timeout`), retries it once on a fresh connection after a
connection error, and maps what redis-py raises to KeyStoreUnavailableError (503, fail closed).

Why our own retry and not redis-py's `Retry`: redis-py retries a command after any connection error or
timeout, including one raised while reading the reply, when the command may already have run; an admission
script run twice would charge a key twice. So redis-py's command retry stays off (`retries=0`), and only
calls whose scripts are idempotent (read-only, or keyed by a lease id, see `ratelimit/redis.py`) are retried
here. A pooled connection that died with a Redis restart is caught before anything is sent: the pool checks
each connection it hands out for a pending EOF and reconnects it (redis-py 8 skips that check while its
"maintenance notifications" are on, a Redis Enterprise feature we do not use, so they are turned off).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final, TypeVar

import redis.asyncio as redis_asyncio
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff
from redis.driver_info import DriverInfo
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError, RedisError
from redis.maint_notifications import MaintNotificationsConfig

from gateway.background import BackgroundTask, Backoff
from gateway.deadline import deadline
from gateway.errors import KeyStoreUnavailableError
from gateway.metrics.instruments import GatewayMetrics
from gateway.redis.script_lane import inline_writes
from gateway.settings import RedisSettings, Settings, parse_redis_url

logger = logging.getLogger(__name__)

T = TypeVar("T")

# What a Redis call can raise when Redis is down, slow or gone: redis-py's errors, socket errors, our deadline.
REDIS_ERRORS: Final = (RedisError, OSError, TimeoutError)
UNAVAILABLE: Final = "The API key store is unavailable; retry shortly."
# Seconds between the PINGs redis-py sends on an idle connection (a pub/sub one's go out from its reads).
_HEALTH_CHECK_INTERVAL: Final = 30
# How long a pub/sub read waits before the listener goes round its loop. A message, a closed connection (EOF,
# reset) and a stop (cancellation) end the wait at once, whatever its length; going round only sends the health
# check PING when it is due. So a long wait loses no reaction and saves idle wake-ups (each listener of each
# worker woke once a second); the PING then goes out within 40 s instead of 31.
_LISTEN_WAIT: Final = 10.0


def connect_redis(settings: Settings) -> redis_asyncio.Redis:
    """A pooled asyncio Redis client for `redis_url` (plain or Sentinel); dead pooled connections are reconnected
    before use (module docstring). Close it with `close_redis`."""
    options: dict[str, Any] = {
        "socket_connect_timeout": settings.redis.connect_timeout,
        "socket_timeout": settings.redis.socket_timeout,
        "health_check_interval": _HEALTH_CHECK_INTERVAL,
        "maint_notifications_config": MaintNotificationsConfig(enabled=False),
        # Resolved once here: left to redis-py, every new pooled connection looks its version up in the
        # package metadata (~3 ms of blocking work each, enough to stall a cold burst).
        "driver_info": DriverInfo(),
    }
    url = settings.redis_url.get_secret_value()
    address = parse_redis_url(url)
    if address is None:
        return inline_writes(
            redis_asyncio.Redis.from_url(
                url, max_connections=settings.redis.max_connections, decode_responses=False, **options
            )
        )
    sentinel_password = settings.redis.sentinel_password
    sentinel = Sentinel(  # type: ignore[no-untyped-call, unused-ignore]  # unannotated before redis-py 8
        address.sentinels,
        # A Sentinel client of redis-py retries 10 times with backoff by default: a dead Sentinel would eat the
        # call's deadline. None here; `discover_master` moves on to the next Sentinel instead.
        sentinel_kwargs={
            **options,
            "retry": Retry(NoBackoff(), 0),
            "password": None if sentinel_password is None else sentinel_password.get_secret_value(),
        },
    )
    master: redis_asyncio.Redis = sentinel.master_for(
        address.service,
        db=address.db,
        username=address.username,
        password=None if address.password is None else address.password.get_secret_value(),
        max_connections=settings.redis.max_connections,
        **options,
    )
    return inline_writes(master)


async def close_redis(client: redis_asyncio.Redis) -> None:
    """Close a client of `connect_redis`, and the connections to the Sentinels it asked, if any."""
    pool = client.connection_pool
    await client.aclose()  # its script lane's connection too
    if isinstance(pool, SentinelConnectionPool):
        await pool.sentinel_manager.aclose()


async def ping_redis(settings: Settings) -> str | None:
    """None if Redis (the master, with Sentinel) answers PING within `redis.command_timeout`, else why not."""
    client = connect_redis(settings)
    try:
        async with deadline(settings.redis.command_timeout):
            await client.ping()
    except REDIS_ERRORS as exc:
        return str(exc) or type(exc).__name__
    finally:
        await close_redis(client)
    return None


class RedisCalls:
    """The error boundary around every Redis call: one deadline, one retry, one mapping."""

    def __init__(self, settings: RedisSettings, metrics: GatewayMetrics | None = None) -> None:
        self.timeout = settings.command_timeout
        # Every call's time and every failure (nemotron_gateway_redis_call_duration_seconds, _redis_errors_total).
        self._duration = None if metrics is None else metrics.redis_call_duration
        self._errors = None if metrics is None else metrics.redis_errors

    def succeeded(self, started: float) -> None:
        """Record a call made outside `__call__` (a script posted on the lane) that Redis answered: its time."""
        if self._duration is not None:
            self._duration.observe(time.perf_counter() - started)

    async def __call__(self, work: Callable[[], Awaitable[T]], *, unavailable: str = UNAVAILABLE) -> T:
        """`await work()` within `redis.command_timeout`; on a connection error or READONLY, once more (on another
        pooled connection, reconnected if dead). `work` must be safe to run twice. KeyStoreUnavailableError
        otherwise."""
        started = time.perf_counter()
        try:
            async with deadline(self.timeout):
                try:
                    return await work()
                except (RedisConnectionError, ReadOnlyError) as exc:
                    # READONLY: a replica refused the command before running it (a failover behind a plain URL).
                    logger.debug("Redis connection error (%s); retrying once on a fresh connection", exc)
                    return await work()
        except REDIS_ERRORS as exc:
            if self._errors is not None:
                self._errors.inc()
            raise KeyStoreUnavailableError(unavailable) from exc
        finally:
            if self._duration is not None:
                self._duration.observe(time.perf_counter() - started)


class PubSubListener:
    """Receives one pub/sub channel in a BackgroundTask, subscribing again after a loss (backoff + jitter).

    `on_message` gets each message's data. `on_gap` is called whenever messages may have been missed: when
    the subscription starts, when it is lost, and when redis-py reconnects it underneath us.
    """

    def __init__(
        self,
        redis: redis_asyncio.Redis,
        channel: str,
        on_message: Callable[[bytes], None],
        *,
        on_gap: Callable[[], None] | None = None,
        stop_timeout: float = 5.0,
    ) -> None:
        self._redis = redis
        self._channel = channel
        self._on_message = on_message
        self._on_gap = on_gap
        self._subscribed = asyncio.Event()
        self._task = BackgroundTask(
            f"pubsub:{channel}",
            self._listen,
            expected=REDIS_ERRORS,
            backoff=Backoff(initial=0.1, maximum=5.0),
            stop_timeout=stop_timeout,
        )

    @property
    def subscribed(self) -> bool:
        """Whether messages are being received right now."""
        return self._subscribed.is_set()

    def start(self) -> None:
        """Start listening (returns at once; see `wait_subscribed`)."""
        self._task.start()

    async def wait_subscribed(self, within: float) -> bool:
        """Wait up to `within` seconds for the subscription; whether it is in place."""
        with contextlib.suppress(TimeoutError):
            async with deadline(within):
                await self._subscribed.wait()
        return self.subscribed

    async def stop(self) -> bool:
        """Stop listening, waiting a bounded time (BackgroundTask.stop)."""
        return await self._task.stop()

    async def _listen(self) -> None:
        pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
        connection: Any = None
        try:
            await pubsub.subscribe(self._channel)
            connection = pubsub.connection
            if connection is not None:
                # redis-py resubscribes by itself after a reconnect; what was published meanwhile is lost.
                connection.register_connect_callback(self._on_reconnect)
            self._gap()
            self._subscribed.set()
            logger.debug("Subscribed to %s", self._channel)
            while True:
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=_LISTEN_WAIT)
                if message is not None and message.get("type") == "message":
                    self._on_message(bytes(message["data"]))
        finally:
            was_subscribed = self.subscribed
            self._subscribed.clear()
            if was_subscribed:
                self._gap()
            if connection is not None:
                connection.deregister_connect_callback(self._on_reconnect)
            with contextlib.suppress(*REDIS_ERRORS):
                await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]  # unannotated before redis-py 8

    def _on_reconnect(self, connection: Any) -> None:
        self._gap()

    def _gap(self) -> None:
        if self._on_gap is not None:
            self._on_gap()
