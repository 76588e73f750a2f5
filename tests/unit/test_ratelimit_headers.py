"""OpenAI's x-ratelimit-* formats, Retry-After rounding, token estimates and limit defaults (no sockets)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
import redis.asyncio as redis_asyncio
from pydantic import ValidationError

from gateway.auth.keys import ApiKey, KeyLimits
from gateway.ratelimit.limiter import format_reset, rate_headers, rate_limit_error
from gateway.ratelimit.redis import RedisRateLimiter
from gateway.settings import AuthSettings, RateLimitSettings, Settings

pytestmark = pytest.mark.timeout(10)

NOW = datetime(2026, 1, 1, tzinfo=UTC)


@pytest.mark.parametrize(
    ("milliseconds", "text"),
    [
        (-5, "0s"),
        (0, "0s"),
        (1, "1ms"),
        (20, "20ms"),
        (999, "999ms"),
        (1000, "1s"),
        (1500, "1.5s"),
        (1001, "1.001s"),
        (59_990, "59.99s"),
        (60_000, "1m0s"),
        (360_000, "6m0s"),
        (61_500, "1m1.5s"),
        (3_600_000, "1h0m0s"),
        (3_723_000, "1h2m3s"),
    ],
)
def test_reset_durations_use_openai_format(milliseconds: int, text: str) -> None:
    assert format_reset(milliseconds) == text


def test_rate_headers_from_bucket_level() -> None:
    # 60 per 60 s window: one unit costs 60_000; 3 used -> 57 left, full again after 3 s.
    headers = rate_headers("requests", 60, 60_000, 3 * 60_000)
    assert headers == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "57",
        "x-ratelimit-reset-requests": "3s",
    }
    # A partly drained unit does not count as available; a bucket in debt reports 0 remaining.
    assert rate_headers("tokens", 1000, 60_000, 59_999)["x-ratelimit-remaining-tokens"] == "999"
    in_debt = rate_headers("tokens", 1000, 60_000, 1100 * 60_000)
    assert in_debt["x-ratelimit-remaining-tokens"] == "0"
    assert in_debt["x-ratelimit-reset-tokens"] == "1m6s"


@pytest.mark.parametrize(
    ("retry_ms", "header"),
    [(0, "1"), (1, "1"), (999, "1"), (1000, "1"), (1001, "2"), (2500, "3"), (60_000, "60")],
)
def test_retry_after_rounds_up_to_whole_seconds(retry_ms: int, header: str) -> None:
    error = rate_limit_error("Rate limit reached: requests per minute (limit 1).", retry_ms, {"x-a": "b"})
    assert error.status_code == 429
    assert error.headers["Retry-After"] == header
    assert error.headers["retry-after-ms"] == str(retry_ms)
    assert error.headers["x-a"] == "b"
    assert error.retry_after == pytest.approx(retry_ms / 1000)


def _limiter(limits: RateLimitSettings) -> RedisRateLimiter:
    # Constructing a client opens no connection; the limiter only needs it for its scripts' digests.
    return RedisRateLimiter(redis_asyncio.Redis(), Settings(limits=limits))


def test_key_limits_override_defaults_and_zero_means_unlimited() -> None:
    limiter = _limiter(RateLimitSettings(requests_per_minute=60, tokens_per_minute=None, max_concurrency=4))
    key = ApiKey(name="a", prefix="", created_at=NOW, limits=KeyLimits(None, 500, 0))
    limits = limiter.effective_limits(key)
    assert (limits.requests_per_minute, limits.tokens_per_minute, limits.max_concurrency) == (60, 500, 0)
    assert not limits.unlimited
    unlimited = ApiKey(name="b", prefix="", created_at=NOW, limits=KeyLimits(0, None, 0))
    assert limiter.effective_limits(unlimited).unlimited


def test_settings_bounds() -> None:
    with pytest.raises(ValidationError, match="lease_renew_interval"):
        RateLimitSettings(lease_ttl=5, lease_renew_interval=5)
    with pytest.raises(ValidationError):
        AuthSettings(cache_ttl=1.5)  # the 1-second revocation promise depends on it
    assert Settings().auth.secret is None and not Settings().auth.fail_open and not Settings().limits.fail_open
