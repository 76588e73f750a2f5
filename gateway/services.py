"""Services: everything a request needs that lives as long as the app, built in the lifespan.

One typed container on `app.state` instead of module globals. Imports services, never routes.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import redis.asyncio as redis_asyncio
from redis.exceptions import RedisError

from gateway.auth import KeyStore
from gateway.metrics.exposition import Exposition
from gateway.metrics.instruments import GatewayMetrics
from gateway.pool.pool import ReplicaPool
from gateway.ratelimit import FailedAuthGuard, RedisRateLimiter
from gateway.redis import close_redis, connect_redis
from gateway.relay.exchange import EngineRelay
from gateway.relay.readiness import SharedPoolState
from gateway.responses import ResponseStore
from gateway.settings import Settings
from gateway.tracing.tracer import Tracer

logger = logging.getLogger(__name__)

Start = Callable[[], Awaitable[None]]
Stop = Callable[[], Awaitable[None]]


@dataclass(slots=True)
class Services:
    """The app's long-lived parts."""

    settings: Settings
    metrics: GatewayMetrics
    pool: ReplicaPool
    relay: EngineRelay
    redis: redis_asyncio.Redis
    keys: KeyStore
    responses: ResponseStore
    limiter: RedisRateLimiter
    guard: FailedAuthGuard
    exposition: Exposition
    tracer: Tracer | None = None  # None: tracing is off (no OTEL_EXPORTER_OTLP_ENDPOINT)

    @classmethod
    def build(cls, settings: Settings, metrics: GatewayMetrics, shared: SharedPoolState) -> Services:
        """Construct (nothing is connected until `start`); `shared` is the gateway's one view of its replicas, which
        every worker process of it shares."""
        redis = connect_redis(settings)
        return cls(
            settings=settings,
            metrics=metrics,
            pool=ReplicaPool(settings, metrics, redis, shared),
            relay=EngineRelay(settings.relay, metrics),
            redis=redis,
            keys=KeyStore(redis, settings, metrics),
            responses=ResponseStore(redis, settings, metrics),
            limiter=RedisRateLimiter(redis, settings, metrics),
            guard=FailedAuthGuard(redis, settings, metrics),
            exposition=Exposition(settings, metrics),
            tracer=Tracer.from_settings(settings, metrics),
        )

    async def start(self) -> None:
        """Open pools and start background probes. When a part fails to start (or the start is cancelled), the parts
        already started are stopped, newest first, and the pools closed before the error goes on: a gateway that
        could not start leaves no client, task or connection behind."""
        started: list[Stop] = []
        try:
            for start, stop in self._parts():
                await start()
                started.append(stop)
        except BaseException:
            await _stop_all([*reversed(started), self._close_pools])
            raise

    def _parts(self) -> list[tuple[Start, Stop]]:
        """What `start` starts, in order, each with what stops it."""
        parts: list[tuple[Start, Stop]] = [
            *([(self.tracer.start, self.tracer.stop)] if self.tracer is not None else []),
            (self.pool.start, self.pool.stop),
            (self._check_redis_at_start, _nothing),
        ]
        if self.settings.auth.enabled:
            parts += [
                (self.keys.start, self.keys.stop),
                (self.limiter.start, self.limiter.stop),
                (self.guard.start, self.guard.stop),
            ]
        return parts

    async def _check_redis_at_start(self) -> None:
        await self.check_redis()  # a Redis that does not answer yet is reported by /ready, not fatal
        if not self.settings.auth.enabled:
            logger.warning("authentication is OFF (NEMOTRON_AUTH__ENABLED=false): anyone reaching this port is served")
        elif not self.keys.hashes_keyed:
            logger.warning(
                "NEMOTRON_AUTH__SECRET is not set: API keys are stored as plain SHA-256 hashes; set a server "
                "secret so a copy of Redis cannot be used to test guessed keys"
            )

    async def stop(self) -> None:
        """Stop probes and background tasks, close pools."""
        await self.guard.stop()
        await self.keys.stop()
        await self.limiter.stop()
        await self.pool.stop()
        if self.tracer is not None:
            await self.tracer.stop()
        await self._close_pools()

    async def _close_pools(self) -> None:
        """Close what `build` made (the Redis pool, NVML): open even when nothing was started."""
        await close_redis(self.redis)
        self.exposition.stop()

    async def check_redis(self) -> str | None:
        """Ping Redis: None when it answers, else why not."""
        try:
            await self.redis.ping()
        except (RedisError, OSError) as exc:
            self.metrics.redis_up.set(0)
            return f"Redis does not answer ({type(exc).__name__})"
        self.metrics.redis_up.set(1)
        return None


async def _nothing() -> None:
    pass


async def _stop_all(stops: list[Stop]) -> None:
    """Run every one of `stops`, in order, whatever the others raise (each failure logged)."""
    for stop in stops:
        try:
            await stop()
        except Exception:
            logger.exception("stopping a part of the gateway after a failed start failed")
