"""The rate limiter's types (the limits that apply, the Lease it hands out) and OpenAI's `x-ratelimit-*` formats.

Imports errors and gateway.usage (the budget windows a lease is charged to) only; the limiter itself lives in
`ratelimit.redis`. Keys are taken structurally (`LimitedKey`), so this package does not depend on `gateway.auth`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

from gateway.errors import RateLimitError
from gateway.usage import BudgetWindows

# A prompt's tokens are estimated from its characters until the engine reports the real usage; the
# estimate is reconciled at release, so erring either way costs only until the request ends.


class KeyLimitsView(Protocol):
    """A key's own limits: None takes the server default, 0 means unlimited."""

    @property
    def requests_per_minute(self) -> int | None: ...

    @property
    def tokens_per_minute(self) -> int | None: ...

    @property
    def max_concurrency(self) -> int | None: ...

    @property
    def daily_tokens(self) -> int | None: ...

    @property
    def monthly_tokens(self) -> int | None: ...


class LimitedKey(Protocol):
    """What the limiter needs of an API key (`gateway.auth.ApiKey` is one)."""

    @property
    def name(self) -> str: ...

    @property
    def limits(self) -> KeyLimitsView: ...


@dataclass(frozen=True, slots=True)
class EffectiveLimits:
    """The limits that apply to one request, defaults resolved; 0 means unlimited."""

    requests_per_minute: int
    tokens_per_minute: int
    max_concurrency: int
    daily_tokens: int = 0
    monthly_tokens: int = 0

    @property
    def unlimited(self) -> bool:
        return not (
            self.requests_per_minute
            or self.tokens_per_minute
            or self.max_concurrency
            or self.daily_tokens
            or self.monthly_tokens
        )


@dataclass(frozen=True, slots=True)
class TokenDetail:
    """A request's tokens as the engine reported them (None: not reported) and the model that served it, for usage
    by API and model."""

    prompt: int | None = None
    completion: int | None = None
    reasoning: int | None = None
    model: str | None = None


@dataclass(eq=False, slots=True)
class Lease:
    """One admitted request: its concurrency slot and token charge, until `RedisRateLimiter.release`."""

    key_name: str
    lease_id: str
    estimated_tokens: int
    limits: EffectiveLimits
    headers: dict[str, str] = field(default_factory=dict)
    api: str = "other"  # the route's API label (chat, responses, ...), for usage by API
    windows: BudgetWindows | None = None  # budget windows charged at admission (None: not admitted through Redis)
    budget_charged: int = 0  # tokens charged to the budget counters up front (reconciled at release)
    degraded: bool = False  # admitted without Redis (`limits.fail_open`); nothing to release
    released: bool = False


def format_reset(milliseconds: int) -> str:
    """A duration as OpenAI writes `x-ratelimit-reset-*` (Go's format): `20ms`, `1.5s`, `6m0s`, `1h2m3s`."""
    if milliseconds <= 0:
        return "0s"
    if milliseconds < 1000:
        return f"{milliseconds}ms"
    hours, rest = divmod(milliseconds, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    whole, fraction = divmod(rest, 1000)
    seconds = f"{whole}.{fraction:03d}".rstrip("0") if fraction else str(whole)
    if hours:
        return f"{hours}h{minutes}m{seconds}s"
    if minutes:
        return f"{minutes}m{seconds}s"
    return f"{seconds}s"


def rate_headers(kind: str, limit: int, window_ms: int, used: int) -> dict[str, str]:
    """`x-ratelimit-{limit,remaining,reset}-{kind}` for a bucket holding `used` (units of limit·ms, see redis.py)."""
    capacity = limit * window_ms
    return {
        f"x-ratelimit-limit-{kind}": str(limit),
        f"x-ratelimit-remaining-{kind}": str(max(0, (capacity - used) // window_ms)),
        f"x-ratelimit-reset-{kind}": format_reset(math.ceil(used / limit)),
    }


def rate_limit_error(
    message: str,
    retry_after_ms: int,
    headers: dict[str, str],
    limit: str = "requests",
    kind: type[RateLimitError] = RateLimitError,
) -> RateLimitError:
    """A 429 (of class `kind`) whose `retry_after` is exact; `Retry-After` is rounded up to whole seconds and
    `retry-after-ms` (read first by both SDKs) keeps the precision."""
    merged = {"retry-after-ms": str(max(retry_after_ms, 0)), **headers}
    return kind(message, retry_after=retry_after_ms / 1000, headers=merged, limit=limit)
