"""Token budgets, usage by API and the audit trail against real Redis: limiters of several "processes" (own
clients) sharing it, a clock moved across midnights instead of waiting for them, the key store's audit trail.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from datetime import UTC, date, datetime, timedelta
from typing import Any

import pytest
import redis.asyncio as redis_asyncio
from pydantic import SecretStr

from gateway.auth import ApiKey, KeyLimits, KeyNotFoundError, KeyStore
from gateway.errors import KeyStoreUnavailableError, QuotaExceededError, RateLimitError
from gateway.ratelimit import Lease, RedisRateLimiter, TokenDetail
from gateway.redis import connect_redis
from gateway.settings import AuthSettings, RateLimitSettings, RedisSettings, Settings
from tests.procs import free_port

pytestmark = pytest.mark.timeout(30)


class Clock:
    """A settable clock for the budget windows."""

    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


def _key(daily: int | None = None, monthly: int | None = None, name: str = "budget") -> ApiKey:
    limits = KeyLimits(0, 0, 0, daily_tokens=daily, monthly_tokens=monthly)
    return ApiKey(name=name, prefix="sk-abcdef", created_at=datetime.now(UTC), limits=limits)


def _settings(url: str, **limits: Any) -> Settings:
    return Settings(
        redis_url=SecretStr(url),
        # 400 concurrent admissions on a busy 2-core machine: the production half-second deadlines would time
        # some out, which is the Redis-fault tests' subject, not this module's.
        redis=RedisSettings(connect_timeout=5.0, socket_timeout=5.0, command_timeout=10.0),
        auth=AuthSettings(secret=SecretStr("budget-pepper")),
        limits=RateLimitSettings.model_validate({"window": 3600.0, **limits}),
    )


class Processes:
    """Limiters with their own Redis clients, as separate gateway processes have."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._clients: list[redis_asyncio.Redis] = []
        self._limiters: list[RedisRateLimiter] = []

    def limiter(self, clock: Callable[[], datetime] | None = None, **limits: Any) -> RedisRateLimiter:
        settings = _settings(self.url, **limits)
        client = connect_redis(settings)
        self._clients.append(client)
        limiter = RedisRateLimiter(client, settings, **({} if clock is None else {"clock": clock}))
        self._limiters.append(limiter)
        return limiter

    def store(self, operator: str | None = None) -> KeyStore:
        settings = _settings(self.url)
        client = connect_redis(settings)
        self._clients.append(client)
        return KeyStore(client, settings, operator=operator)

    async def close(self) -> None:
        # Background releases first: a task left pending would be destroyed with its Redis connection later.
        for limiter in self._limiters:
            await limiter.stop()
        for client in self._clients:
            await client.aclose()


@pytest.fixture
async def processes(redis_clean: str) -> AsyncIterator[Processes]:
    running = Processes(redis_clean)
    yield running
    await running.close()


async def _quota_refusal(limiter: RedisRateLimiter, key: ApiKey, tokens: int) -> QuotaExceededError:
    with pytest.raises(QuotaExceededError) as caught:
        await limiter.acquire(key, tokens)
    return caught.value


# --- a spent budget: 429 insufficient_quota until the window ends ---


async def test_a_spent_daily_budget_refuses_until_midnight(processes: Processes) -> None:
    clock = Clock(datetime(2026, 12, 1, 22, 0, 0, tzinfo=UTC))
    limiter = processes.limiter(clock)
    key = _key(daily=100)
    lease = await limiter.acquire(key, 60)
    assert lease.headers["x-budget-remaining-tokens-day"] == "40"
    assert lease.headers["x-budget-limit-tokens-day"] == "100"
    assert "x-budget-remaining-tokens-month" not in lease.headers  # no monthly budget on this key
    await limiter.release(lease, 60)
    refused = await _quota_refusal(limiter, key, 41)  # 41 more would exceed the 100
    assert refused.status_code == 429 and refused.code == "insufficient_quota" and refused.cause == "budget"
    assert refused.retry_after == pytest.approx(2 * 3600)  # 22:00 UTC to midnight
    assert refused.headers["Retry-After"] == "7200" and refused.headers["x-budget-remaining-tokens-day"] == "40"
    assert "daily token budget (100; 40 left, this request may use 41)" in refused.message
    last = await limiter.acquire(key, 40)  # exactly what is left fits
    assert last.headers["x-budget-remaining-tokens-day"] == "0"
    await limiter.release(last, 40)
    await _quota_refusal(limiter, key, 1)

    clock.now = datetime(2026, 12, 2, 0, 0, 1, tzinfo=UTC)  # the next day: the budget is whole again
    fresh = await limiter.acquire(key, 100)
    assert fresh.headers["x-budget-remaining-tokens-day"] == "0"
    await limiter.release(fresh, 10)
    assert (await limiter.budget_usage(key.name)).day == 10


async def test_the_budget_timezone_moves_the_window_and_the_monthly_budget_rolls_over(processes: Processes) -> None:
    # 23:30 UTC on 30 November is already 1 December, 00:30, in Berlin.
    clock = Clock(datetime(2026, 11, 30, 23, 30, tzinfo=UTC))
    berlin = processes.limiter(clock, budget_timezone="Europe/Berlin")
    utc = processes.limiter(clock)
    key = _key(monthly=50)
    await berlin.release(await berlin.acquire(key, 50), 50)
    refused = await _quota_refusal(berlin, key, 1)
    assert refused.retry_after == pytest.approx(31 * 86_400 - 1800)  # to 1 January, 00:00 in Berlin
    assert "monthly token budget (50; 0 left" in refused.message
    lease = await utc.acquire(key, 50)  # in UTC it is still November: another window, another 50
    assert lease.headers["x-budget-remaining-tokens-month"] == "0"
    await utc.release(lease, 50)


async def test_a_budget_is_exact_across_processes_under_concurrent_load(processes: Processes) -> None:
    budget, per_request = 1000, 7
    limiters = [processes.limiter() for _ in range(2)]
    key = _key(daily=budget, monthly=budget * 10)
    admitted: list[Lease] = []

    async def one(limiter: RedisRateLimiter) -> None:
        try:
            admitted.append(await limiter.acquire(key, per_request))
        except RateLimitError:
            return

    await asyncio.gather(*(one(limiters[index % 2]) for index in range(400)))
    assert len(admitted) == budget // per_request  # 142: every admission that fits, none beyond
    await asyncio.gather(*(limiters[0].release(lease, per_request) for lease in admitted))
    used = await limiters[1].budget_usage(key.name)
    assert used.day == used.month == len(admitted) * per_request <= budget


async def test_the_up_front_charge_is_reconciled_to_the_reported_usage(processes: Processes) -> None:
    limiter = processes.limiter()
    key = _key(daily=100)
    lease = await limiter.acquire(key, 90)  # prompt estimate + max_tokens
    assert lease.headers["x-budget-remaining-tokens-day"] == "10"
    await limiter.release(lease, 12, TokenDetail(prompt=3, completion=9, reasoning=4))
    again = await limiter.acquire(key, 88)  # refunded 78: 88 fits
    assert again.headers["x-budget-remaining-tokens-day"] == "0"
    await limiter.release(again, None)  # usage unknown (a cut stream): the estimate stays charged
    assert (await limiter.budget_usage(key.name)).day == 100
    await limiter.release(again, 5)  # a second release of the same lease changes nothing
    assert (await limiter.budget_usage(key.name)).day == 100


async def test_an_admission_retried_after_a_lost_reply_charges_the_budget_once(processes: Processes) -> None:
    limiter = processes.limiter()
    key = _key(daily=100)
    lease = Lease(key_name=key.name, lease_id="lost-reply", estimated_tokens=30, limits=limiter.effective_limits(key))
    lease.windows = limiter.budget_windows()
    args: list[int | str] = [3_600_000, 0, 0, 0, 30, lease.lease_id, 30_000, 1000]
    budget_args: list[int | str] = [100, 0, lease.windows.day_left_ms, lease.windows.month_left_ms]
    first = await limiter._admit(key.name, lease, args, budget_args)
    second = await limiter._admit(key.name, lease, args, budget_args)  # the same lease: a retry
    assert first == second == (0, 0, 0, 0, 30, 30)
    assert (await limiter.budget_usage(key.name)).day == 30


async def test_a_key_without_a_budget_still_counts_its_use_of_the_windows(processes: Processes) -> None:
    # Needed to refuse a new budget below what was already used (`keys set --daily-tokens`).
    limiter = processes.limiter(requests_per_minute=None, tokens_per_minute=None, max_concurrency=None)
    key = ApiKey(name="open", prefix="sk-abcdef", created_at=datetime.now(UTC))
    await limiter.release(await limiter.acquire(key, 50), 20)
    used = await limiter.budget_usage("open")
    assert (used.day, used.month) == (20, 20)


# --- usage for billing: by UTC day and API, in the release round trip ---


async def test_usage_is_recorded_by_day_and_api(processes: Processes) -> None:
    clock = Clock(datetime(2026, 12, 1, 23, 59, 59, tzinfo=UTC))
    limiter = processes.limiter(clock)
    key = _key(daily=10_000)
    for api, used, detail in (
        ("/v1/chat/completions", 12, TokenDetail(3, 9, 4, "nano")),
        ("/v1/chat/completions", 8, TokenDetail(2, 6, None, "nano")),
        ("/v1/chat/completions", 7, TokenDetail(3, 4, None, "super/v1.5")),  # another model: a row of its own
        ("/v1/completions", 5, TokenDetail(1, 4, None)),  # no model named: billed under ""
    ):
        await limiter.release(await limiter.acquire(key, 50, api), used, detail)
    clock.now += timedelta(seconds=2)  # 2 December (UTC)
    await limiter.release(await limiter.acquire(key, 50, "/v1/responses"), 30, TokenDetail(10, 20, 15, "nano"))
    rows = await limiter.usage_by_api([key.name], date(2026, 11, 30))
    got = [
        (
            r.day.isoformat(),
            r.api,
            r.model,
            r.requests,
            r.tokens,
            r.prompt_tokens,
            r.completion_tokens,
            r.reasoning_tokens,
        )
        for r in rows
    ]
    assert got == [
        ("2026-12-01", "/v1/chat/completions", "nano", 2, 20, 5, 15, 4),
        ("2026-12-01", "/v1/chat/completions", "super/v1.5", 1, 7, 3, 4, 0),
        ("2026-12-01", "/v1/completions", "", 1, 5, 1, 4, 0),
        ("2026-12-02", "/v1/responses", "nano", 1, 30, 10, 20, 15),
    ]
    # The day's totals stay whole across models.
    assert (await limiter.usage([key.name], date(2026, 12, 1)))[key.name].requests == 4
    ttl = await processes._clients[0].ttl(f"nemotron:usage:{{{key.name}}}:20261202")
    assert 399 * 86_400 < ttl <= 400 * 86_400  # NEMOTRON_LIMITS__USAGE_RETENTION_DAYS, default 400


# --- the audit trail: every change, who made it, before and after, never the secret ---


async def test_every_change_to_a_key_is_audited_with_the_fields_before_and_after(processes: Processes) -> None:
    store = processes.store(operator="alice")
    key, secret = await store.create("audited", KeyLimits(requests_per_minute=10, daily_tokens=1000))
    await store.set_limits("audited", KeyLimits(requests_per_minute=10, daily_tokens=500, monthly_tokens=9000))
    await store.set_disabled("audited", True)
    new_secret = await store.rotate("audited")
    await store.revoke("audited")
    await store.delete("audited")
    await processes.store(operator="bob").create("other")
    entries = await processes.store().audit.read("audited")
    assert [entry.action for entry in entries] == ["create", "set", "disable", "rotate", "revoke", "delete"]
    assert {entry.operator for entry in entries} == {"alice"}
    create, change, disable, rotate, revoke, delete = entries
    assert create.before == {} and create.after["limits.daily_tokens"] == 1000 and create.prefix == key.prefix
    assert change.before == {"limits.daily_tokens": 1000, "limits.monthly_tokens": None}
    assert change.after == {"limits.daily_tokens": 500, "limits.monthly_tokens": 9000}
    assert (disable.before, disable.after) == ({"disabled": False}, {"disabled": True})
    assert rotate.before == {"prefix": key.prefix} and rotate.after == {"prefix": new_secret[:9]}
    assert (revoke.before, revoke.after) == ({"revoked": False}, {"revoked": True})
    assert delete.after == {} and delete.before["name"] == "audited" and delete.before["revoked"] is True
    with pytest.raises(KeyNotFoundError):
        await store.get("audited")
    await store.create("audited")  # the name is free again
    everything = await processes.store().audit.read()
    assert [entry.name for entry in everything] == ["audited"] * 6 + ["other", "audited"]
    assert everything[-2].operator == "bob"
    raw = repr(await processes._clients[0].xrange("nemotron:{keys}:audit"))
    for leaked in (secret, new_secret, secret[9:25], new_secret[9:25]):
        assert leaked not in raw


async def test_a_change_is_in_the_trail_even_when_its_cli_dies_right_after_it(
    processes: Processes, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = processes.store(operator="alice")
    await store.create("crashy", KeyLimits(requests_per_minute=5))
    real_get = store.get

    async def dies_once_changed(name: str) -> ApiKey:
        key = await real_get(name)
        if key.limits.requests_per_minute == 7:
            raise RuntimeError("the CLI was killed")
        return key

    monkeypatch.setattr(store, "get", dies_once_changed)
    with pytest.raises(RuntimeError, match="killed"):
        await store.set_limits("crashy", KeyLimits(requests_per_minute=7))
    newest = (await processes.store().audit.read("crashy"))[-1]
    assert (newest.action, newest.before, newest.after) == (
        "set",
        {"limits.requests_per_minute": 5},
        {"limits.requests_per_minute": 7},
    )


async def test_each_entry_holds_only_its_own_change_when_operators_change_a_key_at_once(
    processes: Processes, monkeypatch: pytest.MonkeyPatch
) -> None:
    alice, bob = processes.store(operator="alice"), processes.store(operator="bob")
    await alice.create("shared", KeyLimits(requests_per_minute=5))
    real_get = alice.get
    raced: list[bool] = []

    async def bob_changes_it_meanwhile(name: str) -> ApiKey:
        key = await real_get(name)
        if not raced:  # Bob's change lands between whatever Alice read and her own change
            raced.append(True)
            await bob.set_priority("shared", 3)
        return key

    monkeypatch.setattr(alice, "get", bob_changes_it_meanwhile)
    await alice.set_limits("shared", KeyLimits(requests_per_minute=9))
    entries = {entry.operator: entry for entry in (await processes.store().audit.read("shared"))[1:]}
    assert (entries["alice"].before, entries["alice"].after) == (
        {"limits.requests_per_minute": 5},
        {"limits.requests_per_minute": 9},
    ), "Bob's priority is not Alice's change"
    assert (entries["bob"].before, entries["bob"].after) == ({"priority": None}, {"priority": 3})


async def test_entries_written_before_the_scripts_kept_the_trail_still_read(processes: Processes) -> None:
    store = processes.store()
    client = processes._clients[-1]
    fields = {
        "at": "1764547200000000",
        "operator": "carol",
        "action": "set",
        "name": "older",
        "prefix": "sk-abc123",
        "before": '{"limits.requests_per_minute": 1}',
        "after": '{"limits.requests_per_minute": 2}',
    }
    await client.xadd("nemotron:{keys}:audit", fields)  # type: ignore[arg-type]
    (entry,) = await store.audit.read("older")
    assert (entry.operator, entry.before, entry.after) == (
        "carol",
        {"limits.requests_per_minute": 1},
        {"limits.requests_per_minute": 2},
    )
    assert entry.at.isoformat() == "2025-12-01T00:00:00+00:00"


async def test_the_audit_trail_is_capped(redis_clean: str) -> None:
    settings = Settings(redis_url=SecretStr(redis_clean), auth=AuthSettings(audit_max_entries=100))
    client = connect_redis(settings)
    try:
        store = KeyStore(client, settings)
        await store.create("capped")
        for index in range(400):
            await store.set_limits("capped", KeyLimits(requests_per_minute=index + 1))
        length = await client.xlen("nemotron:{keys}:audit")
        assert 100 <= length < 300  # trimmed approximately (whole stream nodes), never unbounded
        newest = await store.audit.read("capped", limit=1)
        assert newest[0].after == {"limits.requests_per_minute": 400}
    finally:
        await client.aclose()


async def test_redis_down_budgets_fail_closed_or_open_as_the_limits_do() -> None:
    key = _key(daily=10)
    for fail_open in (False, True):
        settings = _settings(f"redis://127.0.0.1:{free_port()}/0", fail_open=fail_open)
        client = connect_redis(settings)
        limiter = RedisRateLimiter(client, settings)
        try:
            if not fail_open:
                with pytest.raises(KeyStoreUnavailableError):
                    await limiter.acquire(key, 1000)
                continue
            lease = await limiter.acquire(key, 1000)  # over the budget, but nothing can be checked or charged
            assert lease.degraded and "x-budget-remaining-tokens-day" not in lease.headers
            await limiter.release(lease, 1000)
        finally:
            await client.aclose()


async def test_an_unconfirmed_admission_is_refunded_its_budget_charge_only_if_it_ran(processes: Processes) -> None:
    limiter = processes.limiter()
    key = _key(daily=100)
    await limiter.release(await limiter.acquire(key, 20), 20)  # 20 used for real

    def lease(lease_id: str) -> Lease:
        made = Lease(key_name=key.name, lease_id=lease_id, estimated_tokens=30, limits=limiter.effective_limits(key))
        made.windows = limiter.budget_windows()
        made.budget_charged = 30  # what the gateway assumes an admission it never saw answered charged
        return made

    ran, never_ran = lease("ran"), lease("never-ran")
    assert ran.windows is not None
    args: list[int | str] = [3_600_000, 0, 0, 0, 30, ran.lease_id, 30_000, 1000]
    await limiter._admit(key.name, ran, args, [100, 0, ran.windows.day_left_ms, ran.windows.month_left_ms])
    assert (await limiter.budget_usage(key.name)).day == 50
    for unconfirmed in (ran, never_ran):
        keys, release_args = limiter._release_call(unconfirmed, 0, served=False, unconfirmed=True)
        await limiter._release(keys=keys, args=release_args)
    assert (await limiter.budget_usage(key.name)).day == 20  # the admission that ran refunded, nothing else taken
