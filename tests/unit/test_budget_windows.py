"""Budget windows (days and months in a configured time zone) and the audit trail's field diff: pure code."""

from __future__ import annotations

import math
import multiprocessing
from datetime import UTC, datetime

import pytest
import redis.asyncio as redis_asyncio

from gateway.auth import ApiKey, KeyLimits
from gateway.auth.audit import changes, key_fields
from gateway.ratelimit import RedisRateLimiter
from gateway.ratelimit.redis import _lease_id
from gateway.settings import RateLimitSettings, Settings

pytestmark = pytest.mark.timeout(5)


def _limiter(zone: str, now: list[datetime]) -> RedisRateLimiter:
    settings = Settings(limits=RateLimitSettings(budget_timezone=zone))
    return RedisRateLimiter(redis_asyncio.Redis(), settings, clock=lambda: now[0])  # never connects


def test_windows_end_at_the_zones_midnight_and_first_of_the_month() -> None:
    now = [datetime(2026, 12, 31, 22, 30, tzinfo=UTC)]  # 23:30 in Berlin
    windows = _limiter("Europe/Berlin", now).budget_windows()
    assert (windows.day, windows.month) == ("d20261231", "m202612")
    assert windows.day_left_ms == windows.month_left_ms == 30 * 60 * 1000
    utc = _limiter("UTC", now).budget_windows()
    assert (utc.day, utc.month, utc.day_left_ms) == ("d20261231", "m202612", 90 * 60 * 1000)


def test_a_day_with_a_daylight_saving_change_is_23_hours_long() -> None:
    now = [datetime(2026, 3, 28, 23, 0, tzinfo=UTC)]  # midnight of 29 March in Berlin, clocks go forward at 2:00
    windows = _limiter("Europe/Berlin", now).budget_windows()
    assert windows.day == "d20260329" and windows.day_left_ms == 23 * 3600 * 1000


def test_windows_follow_the_clock_across_midnight_and_back() -> None:
    now = [datetime(2026, 12, 1, 23, 59, 59, 500_000, tzinfo=UTC)]
    limiter = _limiter("UTC", now)
    assert limiter.budget_windows().day_left_ms == 500
    now[0] = datetime(2026, 12, 2, 0, 0, tzinfo=UTC)
    assert limiter.budget_windows().day == "d20261202"
    now[0] = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
    windows = limiter.budget_windows()
    assert (windows.day, windows.month) == ("d20261130", "m202611")


def test_the_real_clocks_windows_and_usage_day_are_todays() -> None:
    limiter = RedisRateLimiter(redis_asyncio.Redis(), Settings(limits=RateLimitSettings(budget_timezone="UTC")))
    before = datetime.now(UTC)
    windows, today = limiter.budget_windows(), limiter._utc_today()
    after = datetime.now(UTC)
    assert today in {before.date(), after.date()}
    assert windows.day in {f"d{before:%Y%m%d}", f"d{after:%Y%m%d}"}
    # What is left of the day, as the limiter read the clock between `before` and `after` (however long that took).
    next_midnight = datetime(after.year, after.month, after.day, tzinfo=UTC).timestamp() + 86_400
    left_at_after, left_at_before = ((next_midnight - moment.timestamp()) * 1000 for moment in (after, before))
    assert math.floor(left_at_after) <= windows.day_left_ms <= math.ceil(left_at_before)


def _child_lease_ids(queue: multiprocessing.Queue[list[str]]) -> None:
    queue.put([_lease_id() for _ in range(100)])


def test_lease_ids_are_unique_in_a_process_and_in_a_forked_child() -> None:
    # The admission's markers are keyed by lease id across every gateway process: workers are forked.
    mine = [_lease_id() for _ in range(10_000)]
    assert len(set(mine)) == len(mine)
    context = multiprocessing.get_context("fork")
    queue: multiprocessing.Queue[list[str]] = context.Queue()
    child = context.Process(target=_child_lease_ids, args=(queue,))
    child.start()
    theirs = queue.get(timeout=5)
    child.join(5)
    assert not set(theirs) & {*mine, *(_lease_id() for _ in range(100))}
    assert {lease[:12] for lease in theirs} != {lease[:12] for lease in mine}  # another random prefix


def test_an_unknown_budget_timezone_is_a_settings_error() -> None:
    with pytest.raises(ValueError, match="unknown time zone 'Mars/Olympus'"):
        RateLimitSettings(budget_timezone="Mars/Olympus")


def test_audit_changes_hold_only_the_fields_that_changed_and_no_digest() -> None:
    created = datetime(2026, 12, 1, tzinfo=UTC)
    before = ApiKey("a", "sk-abcdef", created, limits=KeyLimits(daily_tokens=10))
    after = ApiKey("a", "sk-abcdef", created, limits=KeyLimits(daily_tokens=20), models=("m",))
    assert changes(before, after) == (
        {"limits.daily_tokens": 10, "models": None},
        {"limits.daily_tokens": 20, "models": ["m"]},
    )
    fields = key_fields(before)
    assert fields["created_at"] == "2026-12-01 00:00:00Z" and "digest" not in fields
    assert changes(None, before) == ({}, fields)
