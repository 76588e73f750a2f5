"""ResponseOwners: which key made each stored Responses API answer, kept in Redis as long as the engine keeps it.

An answer belongs to the key record that made it (`ApiKey.key_id`): a rotated key keeps its answers, a key created
again under a deleted key's name gets none of them. The value is that id, never the secret. Imports settings,
metrics and the Redis boundary (`RedisCalls`: one deadline, one retry, errors mapped to KeyStoreUnavailableError).
"""

from __future__ import annotations

import redis.asyncio as redis_asyncio

from gateway.metrics.instruments import GatewayMetrics
from gateway.redis import RedisCalls
from gateway.settings import Settings

_OWNER = "nemotron:response:{}"


class ResponseOwners:
    """The owner of each stored response, by response id, for `engine.responses_store_ttl` seconds."""

    def __init__(self, redis: redis_asyncio.Redis, settings: Settings, metrics: GatewayMetrics | None = None) -> None:
        self._redis = redis
        self._calls = RedisCalls(settings.redis, metrics)
        self._ttl = int(settings.engine.responses_store_ttl)

    async def owner(self, response_id: str) -> str | None:
        """The id of the key that made `response_id`, or None (unknown, or its time is over)."""
        owner = await self._calls(lambda: self._redis.get(_OWNER.format(response_id)))
        if owner is None:
            return None
        return owner.decode() if isinstance(owner, bytes) else str(owner)

    async def remember(self, response_id: str, owner: str) -> None:
        """Record `owner` as the maker of `response_id` (the write is idempotent, so `RedisCalls` may retry it)."""
        await self._calls(lambda: self._redis.set(_OWNER.format(response_id), owner, ex=self._ttl))
