"""Per-key requests/min, tokens/min, concurrency and token budgets, held across processes in Redis (a request holds
them through one `RequestLease`); the failed-auth guard; admission before the engine's queue."""

from gateway.ratelimit.admission import EngineAdmission
from gateway.ratelimit.guard import FailedAuthGuard
from gateway.ratelimit.lease import RequestLease
from gateway.ratelimit.limiter import (
    BudgetWindows,
    EffectiveLimits,
    Lease,
    LimitedKey,
    RateLimiter,
    TokenDetail,
    format_reset,
)
from gateway.ratelimit.redis import ApiUsage, BudgetUsage, RedisRateLimiter, Usage

__all__ = [
    "ApiUsage",
    "BudgetUsage",
    "BudgetWindows",
    "EffectiveLimits",
    "EngineAdmission",
    "FailedAuthGuard",
    "Lease",
    "LimitedKey",
    "RateLimiter",
    "RedisRateLimiter",
    "RequestLease",
    "TokenDetail",
    "Usage",
    "format_reset",
]
