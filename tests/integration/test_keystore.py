"""KeyStore against a real Redis: records, authentication, invalidation across processes, outages."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta

import pytest
import redis
import redis.asyncio as redis_asyncio
from pydantic import SecretStr

from gateway.auth import KeyExistsError, KeyLimits, KeyNotFoundError, KeyRevokedError, KeyStore
from gateway.auth.keys import INVALID_KEY_MESSAGE
from gateway.errors import AuthenticationError, InvalidRequestError, KeyStoreUnavailableError, PermissionDeniedError
from gateway.ratelimit import RedisRateLimiter
from gateway.redis import connect_redis
from gateway.settings import AuthSettings, RedisSettings, Settings
from tests.procs import ServerProcess, async_wait_until, free_port

pytestmark = pytest.mark.timeout(15)


def _settings(url: str, redis: RedisSettings | None = None, **auth: object) -> Settings:
    return Settings(
        redis_url=SecretStr(url),
        redis=redis or RedisSettings(),
        auth=AuthSettings.model_validate({"secret": "test-pepper", **auth}),
    )


# Redis deadlines past the tests' own timeout: a call on a Redis that is down must fail at once, as waiting out any
# deadline could not end before the test is stopped.
_PATIENT = RedisSettings(connect_timeout=60.0, socket_timeout=60.0, command_timeout=60.0)


@pytest.fixture
def settings(redis_clean: str) -> Settings:
    return _settings(redis_clean)


@pytest.fixture
async def client(settings: Settings) -> AsyncIterator[redis_asyncio.Redis]:
    connection = connect_redis(settings)
    yield connection
    await connection.aclose()


@pytest.fixture
async def store(client: redis_asyncio.Redis, settings: Settings) -> AsyncIterator[KeyStore]:
    keys = KeyStore(client, settings)
    await keys.start()
    yield keys
    await keys.stop()


@pytest.fixture
async def limiter(client: redis_asyncio.Redis, settings: Settings) -> AsyncIterator[RedisRateLimiter]:
    made = RedisRateLimiter(client, settings)
    yield made
    await made.stop()  # before the client closes, as the gateway stops them


@pytest.fixture
async def other_store(settings: Settings) -> AsyncIterator[KeyStore]:
    """A second process's view: its own client (pool, pub/sub connection) and cache. Its cache keeps an entry for a
    minute, longer than a test runs (past the 1 s cap settings validation puts on it, on purpose: model_copy does
    not validate): a change that reaches it can only have come by pub/sub."""
    cached_long = settings.model_copy(update={"auth": settings.auth.model_copy(update={"cache_ttl": 60.0})})
    connection = connect_redis(cached_long)
    keys = KeyStore(connection, cached_long)
    await keys.start()
    yield keys
    await keys.stop()
    await connection.aclose()


async def _rejected(store: KeyStore, secret: str | None) -> bool:
    try:
        await store.authenticate(secret)
    except AuthenticationError as exc:
        assert exc.message == INVALID_KEY_MESSAGE
        return True
    return False


async def test_create_authenticate_get_list(store: KeyStore) -> None:
    assert store.hashes_keyed and store.subscribed
    limits = KeyLimits(requests_per_minute=10, tokens_per_minute=None, max_concurrency=0)
    key, secret = await store.create("alice", limits, models=["nemotron"])
    assert secret.startswith("sk-") and key.prefix == secret[:9]
    assert (key.name, key.limits, key.models) == ("alice", limits, ("nemotron",))
    authenticated = await store.authenticate(secret)
    assert authenticated == key
    assert await store.get("alice") == key
    await store.create("bob")
    assert [k.name for k in await store.list()] == ["alice", "bob"]
    store.check_model(key, "nemotron")
    with pytest.raises(PermissionDeniedError):
        store.check_model(key, "llama")


async def test_duplicate_and_unknown_names(store: KeyStore) -> None:
    await store.create("alice")
    with pytest.raises(KeyExistsError):
        await store.create("alice")
    for call in (
        store.get("nobody"),
        store.revoke("nobody"),
        store.rotate("nobody"),
        store.set_limits("nobody", KeyLimits(1)),
        store.set_disabled("nobody", True),
    ):
        with pytest.raises(KeyNotFoundError):
            await call
    with pytest.raises(InvalidRequestError):
        await store.create("bad name")


async def test_one_message_for_every_rejection(store: KeyStore) -> None:
    revoked_key, revoked = await store.create("revoked")
    await store.revoke("revoked")
    _, disabled = await store.create("disabled")
    await store.set_disabled("disabled", True)
    _, expired = await store.create("expired", expires_at=datetime.now(UTC) - timedelta(seconds=1))
    unknown = "sk-" + "A" * 43
    for secret in (None, "", "Bearer", "sk-short", unknown, revoked, disabled, expired):
        assert await _rejected(store, secret), secret
    # A revoked key stays listed, for the record, but cannot be changed or rotated.
    assert (await store.get("revoked")).revoked
    with pytest.raises(KeyRevokedError):
        await store.rotate("revoked")
    assert revoked_key.prefix == (await store.get("revoked")).prefix


async def test_disable_and_enable(store: KeyStore) -> None:
    _, secret = await store.create("alice")
    await store.authenticate(secret)
    await store.set_disabled("alice", True)
    assert await _rejected(store, secret)
    await store.set_disabled("alice", False)
    assert (await store.authenticate(secret)).name == "alice"


async def test_revoke_reaches_another_process_by_pub_sub(store: KeyStore, other_store: KeyStore) -> None:
    _, secret = await store.create("alice")
    await other_store.authenticate(secret)  # cached there now, for a minute
    await store.revoke("alice")
    await async_wait_until(lambda: _rejected(other_store, secret), within=10, interval=0.005)


async def test_rotate_reaches_another_process_by_pub_sub(store: KeyStore, other_store: KeyStore) -> None:
    key, old = await store.create("alice", KeyLimits(requests_per_minute=7))
    await other_store.authenticate(old)
    new = await store.rotate("alice")
    assert new != old
    await async_wait_until(lambda: _rejected(other_store, old), within=10, interval=0.005)
    rotated = await other_store.authenticate(new)
    assert rotated.limits == key.limits and rotated.prefix == new[:9] != key.prefix


async def test_changed_limits_reach_another_process_by_pub_sub(store: KeyStore, other_store: KeyStore) -> None:
    _, secret = await store.create("alice", KeyLimits(requests_per_minute=5))
    assert (await other_store.authenticate(secret)).limits.requests_per_minute == 5
    updated = await store.set_limits("alice", KeyLimits(requests_per_minute=9), models=["m"])
    assert updated.limits.requests_per_minute == 9 and updated.models == ("m",)

    async def seen() -> bool:
        return (await other_store.authenticate(secret)).limits.requests_per_minute == 9

    await async_wait_until(seen, within=10, interval=0.005)
    assert (await store.set_limits("alice", all_models=True)).models is None


async def test_cache_ttl_bounds_staleness_without_pub_sub(client: redis_asyncio.Redis, settings: Settings) -> None:
    # Never started: no subscription, so only the TTL (0.2 s here) ends the cached entry.
    unsubscribed = KeyStore(client, _settings(settings.redis_url.get_secret_value(), cache_ttl=0.2))
    writer = KeyStore(client, settings)
    _, secret = await writer.create("alice")
    await unsubscribed.authenticate(secret)
    await writer.revoke("alice")
    await unsubscribed.authenticate(secret)  # still cached
    await asyncio.sleep(0.25)
    assert await _rejected(unsubscribed, secret)


async def _lookups(client: redis_asyncio.Redis) -> int:
    """EVALSHA calls Redis has run so far (every key lookup is one)."""
    stats = await client.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


async def test_concurrent_requests_of_an_uncached_key_share_one_lookup(
    store: KeyStore, client: redis_asyncio.Redis
) -> None:
    # A busy key's cache entry expires under all its concurrent requests at once: one lookup, not one each.
    key, secret = await store.create("busy")
    await store.authenticate(secret)  # the lookup script is loaded (a NOSCRIPT reply is counted as a call too)
    store.invalidate("*")
    before = await _lookups(client)
    keys = await asyncio.gather(*(store.authenticate(secret) for _ in range(32)))
    assert all(found == key for found in keys)
    assert await _lookups(client) - before == 1
    # An invalidation (a revoke, say) while a lookup is in flight: that lookup may have read the old record, so a
    # request after it sends its own.
    store.invalidate("*")
    before = await _lookups(client)
    first = asyncio.ensure_future(store.authenticate(secret))
    await asyncio.sleep(0)  # its lookup is in flight
    store.invalidate("busy")
    assert await store.authenticate(secret) == key
    assert await first == key
    assert await _lookups(client) - before == 2


async def test_expiry_applies_to_cached_keys(store: KeyStore) -> None:
    _, secret = await store.create("brief", expires_at=datetime.now(UTC) + timedelta(seconds=0.3))
    await store.authenticate(secret)
    await asyncio.sleep(0.35)
    assert await _rejected(store, secret)
    assert (await store.get("brief")).state(datetime.now(UTC)).value == "expired"


async def test_usage_bookkeeping(store: KeyStore, limiter: RedisRateLimiter) -> None:
    key, _ = await store.create("alice", KeyLimits(tokens_per_minute=10_000))
    before = datetime.now(UTC) - timedelta(seconds=1)
    first = await limiter.acquire(key, 100)
    await limiter.release(first, 40)
    second = await limiter.acquire(key, 50)
    await limiter.release(second, None)  # keeps the estimate
    usage = (await limiter.usage(["alice", "bob"]))["alice"]
    assert (usage.requests, usage.tokens) == (2, 90)
    assert usage.last_used is not None and usage.last_used >= before
    assert (await limiter.usage(["bob"]))["bob"].last_used is None


async def test_the_secret_never_reaches_redis(
    store: KeyStore, client: redis_asyncio.Redis, limiter: RedisRateLimiter
) -> None:
    secrets = []
    for name in ("a", "b", "c"):
        key, secret = await store.create(name, KeyLimits(2, 100, 1), models=["m"])
        secrets.append(secret)
        await store.authenticate(secret)
        await limiter.release(await limiter.acquire(key, 10), 5)
    live = await limiter.acquire(await store.get("c"), 10)  # a lease in flight, a refused guess on record
    secrets.append(await store.rotate("a"))
    await store.revoke("b")
    dump = await _dump(client)
    await limiter.release(live)
    assert len(dump) > 1000
    for secret in secrets:
        hidden = secret[9:]  # all but the display prefix
        assert secret.encode() not in dump
        assert hidden.encode() not in dump
        assert hidden[:12].encode() not in dump


async def _dump(client: redis_asyncio.Redis) -> bytes:
    """Every key name and every stored value of the db, as one blob to search."""
    parts: list[bytes | str] = []
    async for name in client.scan_iter():
        parts.append(name)
        kind = _raw(await client.type(name)).decode()
        if kind == "string":
            parts.append(await client.get(name) or b"")
        elif kind == "hash":
            for field, value in (await client.hgetall(name)).items():
                parts += [field, value]
        elif kind == "set":
            parts += list(await client.smembers(name))
        elif kind == "zset":
            parts += [member async for member, _ in client.zscan_iter(name)]
        elif kind == "stream":  # the audit trail of key changes
            for _, entry in await client.xrange(name):
                parts += [part for pair in entry.items() for part in pair]
        else:
            raise AssertionError(f"unexpected type {kind} for {name!r}")
    return b"\n".join(_raw(part) for part in parts)


def _raw(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


async def test_redis_down_fails_fast_and_closed() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    settings = _settings(url)
    connection = connect_redis(settings)
    store = KeyStore(connection, settings)
    # The calls go to a store whose deadlines outlast the test: a refused connection must fail them at once.
    patient_connection = connect_redis(_settings(url, _PATIENT))
    patient = KeyStore(patient_connection, _settings(url, _PATIENT))
    try:
        await store.start()  # does not raise or hang (it waits one command deadline for the subscription)
        assert not store.subscribed
        for call in (patient.authenticate("sk-" + "A" * 43), patient.create("alice"), patient.list()):
            with pytest.raises(KeyStoreUnavailableError) as caught:
                await call
            assert caught.value.status_code == 503
    finally:
        await store.stop()
        await connection.aclose()
        await patient_connection.aclose()


@pytest.fixture
def private_redis() -> Iterator[tuple[str, ServerProcess]]:
    """A redis-server of our own, so a test can kill it."""
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"

    def answers() -> bool:
        probe = redis.Redis.from_url(url, socket_timeout=0.2, socket_connect_timeout=0.2)
        try:
            return bool(probe.ping())
        except redis.RedisError:
            return False
        finally:
            probe.close()

    argv = ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no", "--bind", "127.0.0.1"]
    with ServerProcess(argv, ready_check=answers, port=port) as server:
        yield url, server


@pytest.mark.parametrize("fail_open", [False, True])
async def test_redis_outage_with_and_without_fail_open(
    private_redis: tuple[str, ServerProcess], fail_open: bool
) -> None:
    url, server = private_redis
    settings = _settings(url, _PATIENT, cache_ttl=0.1, fail_open=fail_open, fail_open_max_age=30.0)
    connection = connect_redis(settings)
    store = KeyStore(connection, settings)
    try:
        key, secret = await store.create("alice")
        assert await store.authenticate(secret) == key
        await asyncio.to_thread(server.stop)
        await asyncio.sleep(0.15)  # past the cache TTL
        if fail_open:
            assert await store.authenticate(secret) == key
        else:
            with pytest.raises(KeyStoreUnavailableError):
                await store.authenticate(secret)
        # A key this process never saw is refused either way.
        with pytest.raises(KeyStoreUnavailableError):
            await store.authenticate("sk-" + "B" * 43)
    finally:
        await store.stop()
        await connection.aclose()


async def test_a_blocked_address_keeps_known_keys_and_its_guesses_cost_no_lookup(
    private_redis: tuple[str, ServerProcess],
) -> None:
    url, server = private_redis
    settings = _settings(url, cache_ttl=0.1)
    connection = connect_redis(settings)
    store = KeyStore(connection, settings)
    await store.start()
    try:
        key, secret = await store.create("alice")
        _, revoked = await store.create("bob")
        # Valid, but never seen by this process: refused while the address is blocked (a guess looks the same).
        with pytest.raises(AuthenticationError):
            await store.authenticate(secret, known_only=True)
        assert await store.authenticate(secret) == key
        assert await store.authenticate(revoked)
        assert await store.authenticate(secret, known_only=True) == key
        await store.revoke("bob")
        await async_wait_until(lambda: _refused(store, revoked), within=5)  # known, but revocation holds

        await asyncio.to_thread(server.stop)
        # Redis is gone: an unknown key from a blocked address is refused without trying Redis (401, not 503).
        with pytest.raises(AuthenticationError):
            await store.authenticate("sk-" + "C" * 43, known_only=True)
    finally:
        await store.stop()
        await connection.aclose()


async def _refused(store: KeyStore, secret: str) -> bool:
    try:
        await store.authenticate(secret, known_only=True)
    except AuthenticationError:
        return True
    return False
