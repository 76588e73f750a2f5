"""Drained replicas: the operator's word that a replica finishes what it has and takes nothing new.

Kept in Redis (one hash, replica URL -> when it was drained), so every worker and every gateway sharing Redis
sees it within one probe interval. Imports nothing of ours but the Redis client's type.
"""

from __future__ import annotations

import time

import redis.asyncio as redis_asyncio

DRAINED_KEY = "nemotron:replicas:drained"


async def drain_replica(redis: redis_asyncio.Redis, url: str) -> None:
    """Drain the replica at `url`: gateways stop giving it new requests (those it has run to their end)."""
    await redis.hset(DRAINED_KEY, url, repr(time.time()))


async def restore_replica(redis: redis_asyncio.Redis, url: str) -> bool:
    """Put the replica at `url` back into the pool; whether it was drained."""
    return bool(await redis.hdel(DRAINED_KEY, url))


async def drained_replicas(redis: redis_asyncio.Redis) -> dict[str, float]:
    """The drained replicas' URLs and when each was drained (time.time())."""
    raw = await redis.hgetall(DRAINED_KEY)
    drained: dict[str, float] = {}
    for url, at in raw.items():
        name = url.decode() if isinstance(url, bytes) else str(url)
        try:
            drained[name] = float(at)
        except ValueError:
            drained[name] = 0.0
    return drained
