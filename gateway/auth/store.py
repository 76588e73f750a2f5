"""KeyStore: API key records in Redis, a short in-process cache, and pub/sub invalidation across processes.

Imports errors, settings and auth.keys. Redis failures are mapped here, once, to KeyStoreUnavailableError.
Redis holds digests only; secrets are never stored, logged, or put in messages.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

import orjson
import redis.asyncio as redis_asyncio
from redis.exceptions import RedisError

from gateway.auth import scripts
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
)
from gateway.errors import AuthenticationError, InvalidRequestError, KeyStoreUnavailableError
from gateway.settings import Settings

logger = logging.getLogger(__name__)

# Every key-store key shares the hash tag `{keys}`, so the scripts below stay in one Redis Cluster slot.
_RECORD = "nemotron:{keys}:name:"
_DIGEST = "nemotron:{keys}:digest:"
_NAMES = "nemotron:{keys}:names"
INVALIDATION_CHANNEL: Final = "nemotron:keys:invalidate"
_FLUSH_ALL = "*"  # published name meaning "drop every cached key"

_UNAVAILABLE = "The API key store is unavailable; retry shortly."


@dataclass(slots=True)
class _Entry:
    key: ApiKey
    fetched_at: float  # monotonic time the Redis read started, so a revoke during the read still ages it out


class KeyStore:
    """API keys in Redis; `authenticate` is the hot path, the other methods serve the `keys` CLI.

    `start()` subscribes to invalidations so a revoked, rotated or changed key stops working on every
    process at once; the cache TTL (at most 1 s) bounds staleness should that subscription drop.
    """

    def __init__(self, redis: redis_asyncio.Redis, settings: Settings) -> None:
        self._redis = redis
        self._settings = settings.auth
        self._hasher = KeyHasher(settings.auth.secret)
        # Bounds each call even when redis-py retries a dead socket several times.
        self._deadline = settings.redis.connect_timeout + settings.redis.socket_timeout
        self._cache: dict[str, _Entry] = {}
        self._generation = 0
        self._listener: asyncio.Task[None] | None = None
        self._subscribed = asyncio.Event()
        self._last_fail_open_warning = 0.0
        self._skip_redis_until = 0.0
        self._lookup = redis.register_script(scripts.LOOKUP)
        self._create = redis.register_script(scripts.CREATE)
        self._list = redis.register_script(scripts.LIST)
        self._revoke = redis.register_script(scripts.REVOKE)
        self._rotate = redis.register_script(scripts.ROTATE)
        self._update = redis.register_script(scripts.UPDATE)

    @property
    def hashes_keyed(self) -> bool:
        """False when `auth.secret` is unset and digests are plain SHA-256 (the app logs a warning)."""
        return self._hasher.keyed

    @property
    def subscribed(self) -> bool:
        """Whether invalidations are currently being received."""
        return self._subscribed.is_set()

    async def start(self) -> None:
        """Start the invalidation listener and wait briefly for its subscription (Redis may be down)."""
        if self._listener is not None:
            return
        self._listener = asyncio.create_task(self._listen(), name="keystore-invalidation")
        try:
            async with asyncio.timeout(self._deadline):
                await self._subscribed.wait()
        except TimeoutError:
            logger.warning("Key invalidations not subscribed yet; cached keys live at most %.1f s", self._cache_ttl)

    async def stop(self) -> None:
        """Cancel the listener and wait for it."""
        task, self._listener = self._listener, None
        if task is None:
            return
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise

    async def authenticate(self, secret: str | None) -> ApiKey:
        """The key for `secret`, or AuthenticationError with one message whatever the reason."""
        if not secret or not looks_like_secret(secret):
            raise AuthenticationError(INVALID_KEY_MESSAGE)
        digest = self._hasher.digest(secret)
        now = time.monotonic()
        entry = self._cache.get(digest)
        if entry is not None and now - entry.fetched_at < self._cache_ttl:
            key = entry.key
        else:
            key = await self._fetch(digest, now, entry)
        if key.state(datetime.now(UTC)) is not KeyState.ACTIVE:
            raise AuthenticationError(INVALID_KEY_MESSAGE)
        return key

    async def create(
        self,
        name: str,
        limits: KeyLimits | None = None,
        expires_at: datetime | None = None,
        models: Sequence[str] | None = None,
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
        )
        fields = _key_to_fields(key, digest)
        async with self._boundary():
            created = await self._create(keys=[_RECORD + name, _DIGEST + digest, _NAMES], args=[name, *fields])
        if not created:
            raise KeyExistsError(f"An API key named '{name}' already exists.", param="name")
        return key, secret

    async def get(self, name: str) -> ApiKey:
        """The key named `name`, whatever its state; KeyNotFoundError if none."""
        async with self._boundary():
            raw = await self._redis.hgetall(_RECORD + validate_name(name))
        if not raw:
            raise KeyNotFoundError(f"No API key is named '{name}'.", param="name")
        return _fields_to_key(raw)[0]

    async def list(self) -> builtins.list[ApiKey]:
        """Every key (revoked ones too), sorted by name."""
        async with self._boundary():
            records = await self._list(keys=[_NAMES], args=[_RECORD])
        keys = [_fields_to_key(_pairs(raw))[0] for raw in records if raw]
        return sorted(keys, key=lambda key: key.name)

    async def revoke(self, name: str) -> None:
        """Revoke `name` for good: it stops working everywhere within a second; the record stays for audit."""
        args = [_DIGEST, INVALIDATION_CHANNEL, name, repr(time.time())]
        async with self._boundary():
            found = await self._revoke(keys=[_RECORD + validate_name(name)], args=args)
        if not found:
            raise KeyNotFoundError(f"No API key is named '{name}'.", param="name")

    async def rotate(self, name: str) -> str:
        """A new secret for `name`, keeping its name, limits and usage; the old secret stops working."""
        secret = generate_secret()
        digest = self._hasher.digest(secret)
        args = [_DIGEST, INVALIDATION_CHANNEL, name, digest, display_prefix(secret)]
        async with self._boundary():
            result = await self._rotate(keys=[_RECORD + validate_name(name), _DIGEST + digest], args=args)
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
            fields += _limit_fields(limits)
        if all_models:
            fields += ["models", ""]
        elif models is not None:
            fields += ["models", orjson.dumps(validate_models(tuple(models))).decode()]
        return await self._apply(name, fields)

    async def set_disabled(self, name: str, disabled: bool) -> ApiKey:
        """Disable (or enable again) a key without revoking it."""
        return await self._apply(name, ["disabled", "1" if disabled else "0"])

    @staticmethod
    def check_model(key: ApiKey, model: str) -> None:
        """Raise PermissionDeniedError unless `key` may use `model` (the served name, aliases resolved)."""
        check_model(key, model)

    def invalidate(self, name: str) -> None:
        """Drop `name` (or every key, for `*`) from this process's cache."""
        self._generation += 1
        if name == _FLUSH_ALL:
            self._cache.clear()
            return
        for digest in [digest for digest, entry in self._cache.items() if entry.key.name == name]:
            del self._cache[digest]

    @property
    def _cache_ttl(self) -> float:
        return self._settings.cache_ttl

    async def _fetch(self, digest: str, now: float, stale: _Entry | None) -> ApiKey:
        may_fail_open = self._settings.fail_open and stale is not None and now - stale.fetched_at < self._fail_open_age
        if may_fail_open and stale is not None and now < self._skip_redis_until:
            return stale.key  # Redis just failed: do not make every request wait for its timeout again
        generation = self._generation
        try:
            async with asyncio.timeout(self._deadline):
                raw = await self._lookup(keys=[_DIGEST + digest], args=[_RECORD])
        except (RedisError, OSError, TimeoutError) as exc:
            if may_fail_open and stale is not None:
                self._skip_redis_until = time.monotonic() + self._cache_ttl
                self._warn_fail_open(exc)
                return stale.key
            raise KeyStoreUnavailableError(_UNAVAILABLE) from exc
        if not raw:
            self._cache.pop(digest, None)
            raise AuthenticationError(INVALID_KEY_MESSAGE)
        key, stored = _fields_to_key(_pairs(raw))
        if not KeyHasher.matches(stored, digest):
            raise AuthenticationError(INVALID_KEY_MESSAGE)
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

    async def _apply(self, name: str, fields: builtins.list[str]) -> ApiKey:
        async with self._boundary():
            result = await self._update(
                keys=[_RECORD + validate_name(name)], args=[INVALIDATION_CHANNEL, name, *fields]
            )
        self._raise_for_update(name, result)
        return await self.get(name)

    @staticmethod
    def _raise_for_update(name: str, result: int) -> None:
        if result == 0:
            raise KeyNotFoundError(f"No API key is named '{name}'.", param="name")
        if result < 0:
            raise KeyRevokedError(f"The API key '{name}' is revoked; create a new one.", param="name")

    @contextlib.asynccontextmanager
    async def _boundary(self) -> AsyncIterator[None]:
        try:
            async with asyncio.timeout(self._deadline):
                yield
        except (RedisError, OSError, TimeoutError) as exc:
            raise KeyStoreUnavailableError(_UNAVAILABLE) from exc

    async def _listen(self) -> None:
        backoff = 0.1
        while True:
            pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
            connection: Any = None
            try:
                await pubsub.subscribe(INVALIDATION_CHANNEL)
                connection = pubsub.connection
                if connection is not None:
                    # redis-py resubscribes by itself after a reconnect; what was published meanwhile is lost.
                    connection.register_connect_callback(self._on_reconnect)
                self.invalidate(_FLUSH_ALL)
                self._subscribed.set()
                logger.debug("Subscribed to key invalidations")
                backoff = 0.1
                while True:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if message is not None and message.get("type") == "message":
                        self.invalidate(bytes(message["data"]).decode())
            except (RedisError, OSError) as exc:
                # Warn once per outage; the cache TTL keeps revocations within a second meanwhile.
                level = logging.WARNING if self._subscribed.is_set() else logging.DEBUG
                logger.log(level, "Key invalidation subscription lost (%s); retrying", type(exc).__name__)
            finally:
                self._subscribed.clear()
                self.invalidate(_FLUSH_ALL)
                if connection is not None:
                    connection.deregister_connect_callback(self._on_reconnect)
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    def _on_reconnect(self, connection: Any) -> None:
        self.invalidate(_FLUSH_ALL)


def _limit_fields(limits: KeyLimits) -> list[str]:
    return [
        "rpm",
        _optional_int(limits.requests_per_minute),
        "tpm",
        _optional_int(limits.tokens_per_minute),
        "concurrency",
        _optional_int(limits.max_concurrency),
    ]


def _optional_int(value: int | None) -> str:
    return "" if value is None else str(value)


def _key_to_fields(key: ApiKey, digest: str) -> list[str]:
    return [
        "v",
        "1",
        "name",
        key.name,
        "digest",
        digest,
        "prefix",
        key.prefix,
        "created_at",
        repr(key.created_at.timestamp()),
        "expires_at",
        "" if key.expires_at is None else repr(key.expires_at.timestamp()),
        "disabled",
        "1" if key.disabled else "0",
        "revoked",
        "0",
        *_limit_fields(key.limits),
        "models",
        "" if key.models is None else orjson.dumps(key.models).decode(),
    ]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _pairs(flat: Sequence[bytes | str]) -> dict[bytes | str, bytes | str]:
    return dict(zip(flat[::2], flat[1::2], strict=True))


def _fields_to_key(raw: Mapping[bytes | str, bytes | str]) -> tuple[ApiKey, str]:
    fields = {_text(field): _text(value) for field, value in raw.items()}
    models = orjson.loads(fields["models"]) if fields.get("models") else None
    key = ApiKey(
        name=fields["name"],
        prefix=fields.get("prefix", ""),
        created_at=datetime.fromtimestamp(float(fields["created_at"]), UTC),
        expires_at=datetime.fromtimestamp(float(fields["expires_at"]), UTC) if fields.get("expires_at") else None,
        disabled=fields.get("disabled") == "1",
        revoked=fields.get("revoked") == "1",
        limits=KeyLimits(
            requests_per_minute=_parse_optional_int(fields.get("rpm")),
            tokens_per_minute=_parse_optional_int(fields.get("tpm")),
            max_concurrency=_parse_optional_int(fields.get("concurrency")),
        ),
        models=tuple(models) if models is not None else None,
    )
    return key, fields.get("digest", "")


def _parse_optional_int(value: str | None) -> int | None:
    return int(value) if value else None
