"""Per-key requests/min, tokens/min and concurrency, held across processes in Redis; the failed-auth guard."""

from gateway.ratelimit.guard import FailedAuthGuard
from gateway.ratelimit.limiter import (
    EffectiveLimits,
    Lease,
    LimitedKey,
    RateLimiter,
    format_reset,
)
from gateway.ratelimit.redis import RedisRateLimiter, Usage

__all__ = [
    "EffectiveLimits",
    "FailedAuthGuard",
    "Lease",
    "LimitedKey",
    "RateLimiter",
    "RedisRateLimiter",
    "Usage",
    "format_reset",
]
