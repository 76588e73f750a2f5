"""Services: everything a request needs that lives as long as the app, built in the lifespan.

One typed container on `app.state` instead of module globals. Imports services, never routes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import redis.asyncio as redis_asyncio
from redis.exceptions import RedisError

from gateway.auth import KeyStore
from gateway.exposition import Exposition
from gateway.metrics import GatewayMetrics
from gateway.ratelimit import EngineAdmission, FailedAuthGuard, RedisRateLimiter
from gateway.redis_client import close_redis, connect_redis
from gateway.relay.activity import EngineActivity
from gateway.relay.client import EngineClient
from gateway.relay.exchange import EngineRelay
from gateway.relay.monitor import EngineMonitor
from gateway.relay.shared import SharedEngineState
from gateway.settings import Settings

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Services:
    """The app's long-lived parts."""

    settings: Settings
    metrics: GatewayMetrics
    engine: EngineClient
    monitor: EngineMonitor
    relay: EngineRelay
    redis: redis_asyncio.Redis
    keys: KeyStore
    limiter: RedisRateLimiter
    admission: EngineAdmission
    guard: FailedAuthGuard
    exposition: Exposition

    @classmethod
    def build(cls, settings: Settings, metrics: GatewayMetrics, shared: SharedEngineState) -> Services:
        """Construct (nothing is connected until `start`); `shared` is the gateway's one view of the engine, which
        every worker process of it shares."""
        engine = EngineClient(settings)
        activity = EngineActivity(shared)
        redis = connect_redis(settings)
        admission = EngineAdmission(redis, settings, metrics)
        monitor = EngineMonitor(engine, settings, metrics, activity, load_observer=admission.observe)
        return cls(
            settings=settings,
            metrics=metrics,
            engine=engine,
            monitor=monitor,
            relay=EngineRelay(engine, monitor, activity, settings, metrics),
            redis=redis,
            keys=KeyStore(redis, settings, metrics),
            limiter=RedisRateLimiter(redis, settings, metrics),
            admission=admission,
            guard=FailedAuthGuard(redis, settings, metrics),
            exposition=Exposition(settings, metrics),
        )

    async def start(self) -> None:
        """Open pools and start background probes."""
        await self.engine.start()
        await self.monitor.start()
        await self.check_redis()
        if self.settings.auth.enabled:
            if not self.keys.hashes_keyed:
                logger.warning(
                    "NEMOTRON_AUTH__SECRET is not set: API keys are stored as plain SHA-256 hashes; set a server "
                    "secret so a copy of Redis cannot be used to test guessed keys"
                )
            await self.keys.start()
            await self.limiter.start()
            await self.guard.start()
        else:
            logger.warning("authentication is OFF (NEMOTRON_AUTH__ENABLED=false): anyone reaching this port is served")

    async def stop(self) -> None:
        """Stop probes and background tasks, close pools."""
        await self.guard.stop()
        await self.keys.stop()
        await self.limiter.stop()
        await self.monitor.stop()
        await self.engine.stop()
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
