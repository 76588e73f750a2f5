"""RequestLease: one request's hold on its API key's rate limits, from the early refusal to the one release.

The route makes one for each request of a key and calls `precheck` before it reads the body (a key this process
has just refused is refused again at no cost), then `acquire` once the request is prepared (the limiter charges
the estimate and takes a concurrency slot in one Redis round trip); the exchange with the engine calls `release`
when it ends, on every path, with the tokens the engine reported. What makes this exact across processes,
idempotent per lease across a Redis restart, and safe when Redis fails (admitted without limits when
`limits.fail_open`, refused otherwise; an admission or release Redis did not confirm is released in the
background) is the limiter's (`ratelimit/redis.py`): the lease is the one object a request carries instead of
three calls to the limiter.

A key this process admitted last time may be admitted beside its request (`acquire_beside`, see
`RedisRateLimiter.claim_beside`): the request goes on to the engine while Redis decides, and the exchange holds the
answer back until it has. A release that comes before that admission has ended waits for it, so nothing it took stays
held. Imports the limiter and its types, and the request record.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from gateway.ratelimit.limiter import Lease, LimitedKey, TokenDetail
from gateway.ratelimit.redis import RedisRateLimiter
from gateway.request_record import RequestRecord

# Releases left to finish after their request's task was cancelled (a reference each until done).
_late_releases: set[asyncio.Task[None]] = set()


def _release_later(release: Coroutine[Any, Any, None]) -> None:
    task = asyncio.create_task(release)
    _late_releases.add(task)
    task.add_done_callback(_late_releases.discard)


class RequestLease:
    """One request's lease on its key's limits: `precheck`, then `acquire`, then `release` (once; safe to repeat)."""

    __slots__ = ("_acquiring", "_api", "_held", "_key", "_limiter")

    def __init__(self, limiter: RedisRateLimiter, key: LimitedKey, api: str) -> None:
        self._limiter = limiter
        self._key = key
        self._api = api  # the route's API label (chat, responses, ...), for usage by API
        self._held: Lease | None = None
        self._acquiring: asyncio.Task[None] | None = None

    def precheck(self) -> None:
        """RateLimitError if the key is known to be over its requests/min or concurrency right now (no Redis call,
        nothing consumed): a cheap refusal before the request body is read."""
        self._limiter.precheck(self._key)

    async def acquire(self, estimated_tokens: int) -> None:
        """Admit the request, charging `estimated_tokens` up front; RateLimitError (or QuotaExceededError for a spent
        token budget) when a limit refuses it."""
        self._held = await self._limiter.acquire(self._key, estimated_tokens, self._api)

    def acquire_beside(self, estimated_tokens: int) -> asyncio.Task[None] | None:
        """`acquire` in a task of its own, to run while the request is already on its way to the engine (the task
        raises the refusal); None when the key's admission must come first (`RedisRateLimiter.claim_beside`)."""
        if not self._limiter.claim_beside(self._key):
            return None
        acquiring = self._acquiring = asyncio.create_task(self.acquire(estimated_tokens))
        acquiring.add_done_callback(self._end_beside)  # however it ends, even cancelled before it ran
        return acquiring

    def _end_beside(self, _: asyncio.Task[None]) -> None:
        self._limiter.end_beside(self._key)

    @property
    def headers(self) -> dict[str, str]:
        """The key's `x-ratelimit-*` and `x-budget-*` headers for the answer (none before `acquire`)."""
        return self._held.headers if self._held is not None else {}

    async def release(
        self, used_tokens: int | None, record: RequestRecord | None = None, *, served: bool = True
    ) -> None:
        """Reconcile the charge with `used_tokens` (None keeps the estimate, 0 refunds it), free the slot and record
        the usage, by API and model, with the token detail the engine reported on `record`; a request not `served`
        (it never reached the engine) is given back to the requests/min limit too and is not in the usage. Nothing
        before `acquire`; idempotent; never raises for Redis. Returns once the release is on its way to Redis, ahead
        of whatever the caller sends next (the answer), not once Redis has confirmed it (see `RedisRateLimiter`)."""
        acquiring = self._acquiring
        if acquiring is not None:
            self._acquiring = None
            if not acquiring.done():  # the exchange ended first: what the admission takes is given back
                try:
                    await asyncio.wait({acquiring})
                except asyncio.CancelledError:
                    acquiring.add_done_callback(
                        lambda _: _release_later(self.release(used_tokens, record, served=served))
                    )
                    raise
            if not acquiring.cancelled():
                _ = acquiring.exception()  # a refusal: the exchange raised it, or the exchange's own error won
        if self._held is None:
            return
        detail = None
        if record is not None:
            detail = TokenDetail(record.prompt_tokens, record.completion_tokens, record.reasoning_tokens, record.model)
        await self._limiter.release(self._held, used_tokens, detail, served=served)
