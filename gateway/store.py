"""Builds the asyncio Redis client (pool, tight timeouts) from settings; shared by the app and the CLI.

Imports settings only. Redis errors are mapped to gateway errors by the services that use the client.
"""

from __future__ import annotations

import redis.asyncio as redis_asyncio
from redis.driver_info import DriverInfo

from gateway.settings import Settings


def connect_redis(settings: Settings) -> redis_asyncio.Redis:
    """A pooled asyncio Redis client; no command may wait longer than the configured socket timeout."""
    return redis_asyncio.Redis.from_url(
        settings.redis_url.get_secret_value(),
        socket_connect_timeout=settings.redis.connect_timeout,
        socket_timeout=settings.redis.socket_timeout,
        max_connections=settings.redis.max_connections,
        health_check_interval=30,
        decode_responses=False,
        # Resolved once here: left to redis-py, every new pooled connection looks its version up in the
        # package metadata (~3 ms of blocking work each, enough to stall a cold burst).
        driver_info=DriverInfo(),
    )
