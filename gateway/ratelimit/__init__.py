"""Per-key requests/min, tokens/min, concurrency and token budgets, held across processes in Redis (a request holds
them through one `RequestLease`); the failed-auth guard; admission before the engine's queue. The usage records are
gateway.usage's (re-exported here), which the `keys` CLI reads without this package."""

from gateway.ratelimit.admission import EngineAdmission
from gateway.ratelimit.guard import FailedAuthGuard
from gateway.ratelimit.lease import RequestLease
from gateway.ratelimit.limiter import (
    EffectiveLimits,
    Lease,
    LimitedKey,
    TokenDetail,
    format_reset,
)
from gateway.ratelimit.redis import RedisRateLimiter
from gateway.usage import ApiUsage, BudgetUsage, BudgetWindows, Usage

__all__ = [
    "ApiUsage",
    "BudgetUsage",
    "BudgetWindows",
    "EffectiveLimits",
    "EngineAdmission",
    "FailedAuthGuard",
    "Lease",
    "LimitedKey",
    "RedisRateLimiter",
    "RequestLease",
    "TokenDetail",
    "Usage",
    "format_reset",
]
