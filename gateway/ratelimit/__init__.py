"""Per-key requests/min, tokens/min and concurrency, held across processes in Redis; the failed-auth guard;
admission before the engine's queue."""

from gateway.ratelimit.admission import EngineAdmission
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
    "EngineAdmission",
    "FailedAuthGuard",
    "Lease",
    "LimitedKey",
    "RateLimiter",
    "RedisRateLimiter",
    "Usage",
    "format_reset",
]
