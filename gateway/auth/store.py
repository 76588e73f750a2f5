"""KeyStore: API key records in Redis, a short in-process cache, and pub/sub invalidation across processes.

Imports errors, settings, metrics, auth.keys, auth.record, auth.audit, auth.scripts and gateway.redis, whose boundary
(`RedisCalls`) maps Redis failures to KeyStoreUnavailableError. Redis holds digests only; secrets are never
stored, logged, or put in messages.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Final

import orjson
import redis.asyncio as redis_asyncio

from gateway.auth import scripts
from gateway.auth.audit import AUDIT_STREAM, KeyAudit
from gateway.auth.keys import (
    INVALID_KEY_MESSAGE,
    ApiKey,
    KeyExistsError,
    KeyHasher,
    KeyLimits,
    KeyNotFoundError,
    KeyRevokedError,
    KeyState,
    check_model,
    display_prefix,
    generate_secret,
    looks_like_secret,
    validate_models,
    validate_name,
    validate_priority,
)
from gateway.auth.record import fields_to_key, key_to_fields, limit_fields, optional_int, pairs
from gateway.errors import AuthenticationError, InvalidRequestError, KeyStoreUnavailableError
from gateway.metrics.instruments import GatewayMetrics
from gateway.redis import DirectScript, PubSubListener, RedisCalls
from gateway.settings import Settings

logger = logging.getLogger(__name__)

# Every key-store key shares the hash tag `{keys}`, so the scripts below stay in one Redis Cluster slot.
_RECORD = "nemotron:{keys}:name:"
_DIGEST = "nemotron:{keys}:digest:"
_NAMES = "nemotron:{keys}:names"
INVALIDATION_CHANNEL: Final = "nemotron:keys:invalidate"
_FLUSH_ALL = "*"  # published name meaning "drop every cached key"


@dataclass(slots=True)
class _Entry:
    key: ApiKey
    fetched_at: float  # monotonic time the Redis read started, so a revoke during the read still ages it out


class KeyStore:
    """API keys in Redis; `authenticate` is the hot path, the other methods serve the `keys` CLI.

    `start()` subscribes to invalidations so a revoked, rotated or changed key stops working on every
    process at once; the cache TTL (at most 1 s) bounds staleness should that subscription drop.
    """

    def __init__(
        self,
        redis: redis_asyncio.Redis,
        settings: Settings,
        metrics: GatewayMetrics | None = None,
        operator: str | None = None,
    ) -> None:
        self._redis = redis
        self._settings = settings.auth
        self._hasher = KeyHasher(settings.auth.secret)
        self._calls = RedisCalls(settings.redis, metrics)
        # Every change below is recorded, with `operator` (default: the OS user), in the audit trail by the change's
        # own script.
        self.audit = KeyAudit(redis, self._calls, settings.auth.audit_max_entries, operator)
        # A revoked or changed key's per-key series stop being exported (the per-key series stay bounded).
        self._metrics = metrics
        self._cache: dict[str, _Entry] = {}
        # Digests that authenticated in this process (insertion-ordered, bounded): a client address blocked
        # by the failed-auth guard may still use these, and only these, so its guesses are never looked up.
        self._known: dict[str, None] = {}
        self._generation = 0
        # Digest -> (generation it started in, the lookup in flight): see `_fetch_once`.
        self._fetching: dict[str, tuple[int, asyncio.Future[ApiKey]]] = {}
        self._listener = PubSubListener(
            redis, INVALIDATION_CHANNEL, self._on_invalidation, on_gap=self._flush, stop_timeout=self._calls.timeout + 1
        )
        self._last_fail_open_warning = 0.0
        self._skip_redis_until = 0.0
        self._lookup = DirectScript(redis, scripts.LOOKUP)
        self._create = DirectScript(redis, scripts.CREATE)
        self._list = DirectScript(redis, scripts.LIST)
        self._revoke = DirectScript(redis, scripts.REVOKE)
        self._rotate = DirectScript(redis, scripts.ROTATE)
        self._update = DirectScript(redis, scripts.UPDATE)
        self._delete = DirectScript(redis, scripts.DELETE)

    @property
    def hashes_keyed(self) -> bool:
        """False when `auth.secret` is unset and digests are plain SHA-256 (the app logs a warning)."""
        return self._hasher.keyed

    @property
    def subscribed(self) -> bool:
        """Whether invalidations are currently being received."""
        return self._listener.subscribed

    async def start(self) -> None:
        """Start the invalidation listener and wait briefly for its subscription (Redis may be down)."""
        self._listener.start()
        if not await self._listener.wait_subscribed(self._calls.timeout):
            logger.warning("Key invalidations not subscribed yet; cached keys live at most %.1f s", self._cache_ttl)

    async def stop(self) -> None:
        """Stop the listener (a bounded wait, even if Redis is gone)."""
        await self._listener.stop()

    async def authenticate(self, secret: str | None, *, known_only: bool = False) -> ApiKey:
        """The key for `secret`, or AuthenticationError with one message whatever the reason.

        `known_only` (a client address blocked for guessing): a secret that never authenticated in this
        process fails at once, without a Redis lookup; a known one is checked as usual (revocation holds).
        """
        if not secret or not looks_like_secret(secret):
            raise AuthenticationError(INVALID_KEY_MESSAGE, cause="malformed")
        digest = self._hasher.digest(secret)
        if known_only and digest not in self._known:
            raise AuthenticationError(INVALID_KEY_MESSAGE, cause="blocked")
        now = time.monotonic()
        entry = self._cache.get(digest)
        if entry is not None and now - entry.fetched_at < self._cache_ttl:
            key = entry.key
        else:
            key = await self._fetch_once(digest, now, entry)
        if key.state(datetime.now(UTC)) is not KeyState.ACTIVE:
            raise AuthenticationError(INVALID_KEY_MESSAGE, cause="inactive")
        if digest not in self._known:
            if len(self._known) >= self._settings.cache_size:
                del self._known[next(iter(self._known))]
            self._known[digest] = None
        return key

    async def create(
        self,
        name: str,
        limits: KeyLimits | None = None,
        expires_at: datetime | None = None,
        models: Sequence[str] | None = None,
        priority: int | None = None,
    ) -> tuple[ApiKey, str]:
        """A new key and its secret (shown once; only its digest is stored). KeyExistsError if the name is taken."""
        validate_name(name)
        if expires_at is not None and expires_at.tzinfo is None:
            raise InvalidRequestError("expires_at must carry a time zone", param="expires_at")
        secret = generate_secret()
        digest = self._hasher.digest(secret)
        key = ApiKey(
            name=name,
            prefix=display_prefix(secret),
            created_at=datetime.now(UTC),
            expires_at=expires_at,
            limits=limits or KeyLimits(),
            models=validate_models(tuple(models) if models is not None else None),
            priority=validate_priority(priority),
        )
        fields, trail = key_to_fields(key, digest), self.audit.script_args("create")
        created = await self._calls(
            lambda: self._create(
                keys=[_RECORD + name, _DIGEST + digest, _NAMES, AUDIT_STREAM], args=[name, *fields, *trail]
            )
        )
        if not created:
            raise KeyExistsError(f"An API key named '{name}' already exists.", param="name")
        return key, secret

    async def get(self, name: str) -> ApiKey:
        """The key named `name`, whatever its state; KeyNotFoundError if none."""
        record = _RECORD + validate_name(name)
        raw = await self._calls(lambda: self._redis.hgetall(record))
        if not raw:
            raise KeyNotFoundError(f"No API key is named '{name}'.", param="name")
        return fields_to_key(raw)[0]

    async def list(self) -> builtins.list[ApiKey]:
        """Every key (revoked ones too), sorted by name."""
        records = await self._calls(lambda: self._list(keys=[_NAMES], args=[_RECORD]))
        keys = [fields_to_key(pairs(raw))[0] for raw in records if raw]
        return sorted(keys, key=lambda key: key.name)

    async def revoke(self, name: str) -> None:
        """Revoke `name` for good: it stops working everywhere within a second; the record stays for audit."""
        args = [_DIGEST, INVALIDATION_CHANNEL, name, repr(time.time()), *self.audit.script_args("revoke")]
        record = _RECORD + validate_name(name)
        found = await self._calls(lambda: self._revoke(keys=[record, AUDIT_STREAM], args=args))
        if not found:
            raise KeyNotFoundError(f"No API key is named '{name}'.", param="name")

    async def delete(self, name: str) -> None:
        """Delete `name`'s record (revoked or not): it stops working everywhere within a second and its name is free
        again; only the audit trail remembers it."""
        args = [_DIGEST, INVALIDATION_CHANNEL, name, *self.audit.script_args("delete")]
        keys = [_RECORD + validate_name(name), _NAMES, AUDIT_STREAM]
        found = await self._calls(lambda: self._delete(keys=keys, args=args))
        if not found:
            raise KeyNotFoundError(f"No API key is named '{name}'.", param="name")

    async def rotate(self, name: str) -> str:
        """A new secret for `name`, keeping its name, limits and usage; the old secret stops working."""
        secret = generate_secret()
        digest = self._hasher.digest(secret)
        args = [_DIGEST, INVALIDATION_CHANNEL, name, digest, display_prefix(secret), *self.audit.script_args("rotate")]
        keys = [_RECORD + validate_name(name), _DIGEST + digest, AUDIT_STREAM]
        result = await self._calls(lambda: self._rotate(keys=keys, args=args))
        self._raise_for_update(name, result)
        return secret

    async def set_limits(
        self,
        name: str,
        limits: KeyLimits | None = None,
        models: Sequence[str] | None = None,
        *,
        all_models: bool = False,
    ) -> ApiKey:
        """Replace the key's limits (when given) and allowed models (when given; `all_models` lifts the list)."""
        fields: builtins.list[str] = []
        if limits is not None:
            fields += limit_fields(limits)
        if all_models:
            fields += ["models", ""]
        elif models is not None:
            fields += ["models", orjson.dumps(validate_models(tuple(models))).decode()]
        return await self._apply(name, fields, "set")

    async def set_priority(self, name: str, priority: int | None) -> ApiKey:
        """Change the key's scheduling priority (None: the server default)."""
        return await self._apply(name, ["priority", optional_int(validate_priority(priority))])

    async def set_disabled(self, name: str, disabled: bool) -> ApiKey:
        """Disable (or enable again) a key without revoking it."""
        return await self._apply(name, ["disabled", "1" if disabled else "0"], "disable" if disabled else "enable")

    @staticmethod
    def check_model(key: ApiKey, model: str) -> None:
        """Raise PermissionDeniedError unless `key` may use `model` (the served name, aliases resolved)."""
        check_model(key, model)

    def invalidate(self, name: str) -> None:
        """Drop `name` (or every key, for `*`) from this process's cache."""
        self._generation += 1
        if self._metrics is not None:
            self._metrics.forget_key(name)
        if name == _FLUSH_ALL:
            self._cache.clear()
            return
        for digest in [digest for digest, entry in self._cache.items() if entry.key.name == name]:
            del self._cache[digest]

    @property
    def _cache_ttl(self) -> float:
        return self._settings.cache_ttl

    async def _fetch_once(self, digest: str, now: float, stale: _Entry | None) -> ApiKey:
        """`_fetch`, shared: requests with one key that find its cache entry expired at once (every concurrent
        request of a busy key, once a second) wait for one lookup instead of sending one each, unless an
        invalidation came since that lookup started (it may have read what was just revoked). Shielded: a
        request that goes away does not end the lookup the others wait for."""
        pending = self._fetching.get(digest)
        if pending is not None and pending[0] == self._generation:
            return await asyncio.shield(pending[1])
        lookup = asyncio.ensure_future(self._fetch(digest, now, stale))
        self._fetching[digest] = (self._generation, lookup)

        def forget(done: asyncio.Future[ApiKey]) -> None:
            current = self._fetching.get(digest)
            if current is not None and current[1] is done:
                del self._fetching[digest]

        lookup.add_done_callback(forget)
        return await asyncio.shield(lookup)

    async def _fetch(self, digest: str, now: float, stale: _Entry | None) -> ApiKey:
        may_fail_open = self._settings.fail_open and stale is not None and now - stale.fetched_at < self._fail_open_age
        if may_fail_open and stale is not None and now < self._skip_redis_until:
            return stale.key  # Redis just failed: do not make every request wait for its timeout again
        generation = self._generation
        try:
            raw = await self._calls(lambda: self._lookup(keys=[_DIGEST + digest], args=[_RECORD]))
        except KeyStoreUnavailableError as exc:
            if may_fail_open and stale is not None:
                self._skip_redis_until = time.monotonic() + self._cache_ttl
                self._warn_fail_open(exc.__cause__ or exc)
                return stale.key
            raise
        if not raw:
            self._cache.pop(digest, None)
            raise AuthenticationError(INVALID_KEY_MESSAGE, cause="unknown")
        key, stored = fields_to_key(pairs(raw))
        if not KeyHasher.matches(stored, digest):
            raise AuthenticationError(INVALID_KEY_MESSAGE, cause="unknown")
        if generation == self._generation:
            self._remember(digest, _Entry(key, now))
        return key

    @property
    def _fail_open_age(self) -> float:
        return self._settings.fail_open_max_age

    def _remember(self, digest: str, entry: _Entry) -> None:
        self._cache.pop(digest, None)
        if len(self._cache) >= self._settings.cache_size:
            del self._cache[next(iter(self._cache))]  # oldest insertion first: entries live a second anyway
        self._cache[digest] = entry

    def _warn_fail_open(self, exc: BaseException) -> None:
        now = time.monotonic()
        if now - self._last_fail_open_warning > 10.0:
            self._last_fail_open_warning = now
            logger.warning("Redis unavailable (%s); admitting cached keys (auth.fail_open)", type(exc).__name__)

    async def _apply(self, name: str, fields: builtins.list[str], action: str = "set") -> ApiKey:
        """Change `fields` of the record and record `action` with the fields before and after in the audit trail."""
        keys = [_RECORD + validate_name(name), AUDIT_STREAM]
        args = [INVALIDATION_CHANNEL, name, *fields, *self.audit.script_args(action)]
        result = await self._calls(lambda: self._update(keys=keys, args=args))
        self._raise_for_update(name, result)
        return await self.get(name)

    @staticmethod
    def _raise_for_update(name: str, result: int) -> None:
        if result == 0:
            raise KeyNotFoundError(f"No API key is named '{name}'.", param="name")
        if result < 0:
            raise KeyRevokedError(f"The API key '{name}' is revoked; create a new one.", param="name")

    def _on_invalidation(self, data: bytes) -> None:
        self.invalidate(data.decode())

    def _flush(self) -> None:
        # Invalidations may have been missed (subscribing, lost, reconnected): the cache cannot be trusted.
        self.invalidate(_FLUSH_ALL)
