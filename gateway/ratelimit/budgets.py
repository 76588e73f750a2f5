"""Token budgets at admission: what the admission script is told, what the answer says, and the refusal.

A key's daily and monthly token budgets (in `limits.budget_timezone`) are plain counters per window (their keys and
windows: gateway.usage), charged up front in the admission script and reconciled in the release script like
tokens/min, so they cost no extra round trip. Imports errors, metrics, gateway.usage and ratelimit.limiter only.
"""

from __future__ import annotations

from gateway.errors import QuotaExceededError
from gateway.metrics.instruments import GatewayMetrics
from gateway.ratelimit.limiter import EffectiveLimits, Lease, format_reset
from gateway.usage import BudgetWindows


def budget_args(limits: EffectiveLimits, windows: BudgetWindows) -> list[int | str]:
    """The admission script's budget arguments (after the marker's TTL, see `lua.ACQUIRE`)."""
    return [limits.daily_tokens, limits.monthly_tokens, windows.day_left_ms, windows.month_left_ms]


def charge_budget(lease: Lease) -> None:
    """Mark `lease`'s estimate as charged to its budgets (where it has one), so that its release refunds it."""
    if lease.limits.daily_tokens or lease.limits.monthly_tokens:
        lease.budget_charged = lease.estimated_tokens


def budget_headers(limits: EffectiveLimits, day_used: int, month_used: int) -> dict[str, str]:
    """`x-budget-{limit,remaining}-tokens-{day,month}` for the budgets the key has."""
    headers: dict[str, str] = {}
    for window, limit, used in (("day", limits.daily_tokens, day_used), ("month", limits.monthly_tokens, month_used)):
        if limit:
            headers[f"x-budget-limit-tokens-{window}"] = str(limit)
            headers[f"x-budget-remaining-tokens-{window}"] = str(max(0, limit - used))
    return headers


def quota_refusal(
    limits: EffectiveLimits,
    tokens: int,
    used: tuple[int, int],
    retry_ms: int,
    headers: dict[str, str],
    budget_timezone: str,
) -> QuotaExceededError:
    """The 429 `insufficient_quota` for a request of `tokens` refused by a spent budget (`used`: the day's and the
    month's tokens), with Retry-After to the window's end."""
    spent = []
    tokens_left: list[int] = []
    for window, limit, window_used in (
        ("daily", limits.daily_tokens, used[0]),
        ("monthly", limits.monthly_tokens, used[1]),
    ):
        if not limit:
            continue
        left = max(0, limit - window_used)
        tokens_left.append(left)
        if window_used + tokens > limit:
            spent.append(f"{window} token budget ({limit}; {left} left, this request may use {tokens})")
    message = (
        f"This API key's {' and '.join(spent)} is spent; it refills in {format_reset(retry_ms)} "
        f"(at {budget_timezone} midnight). Lower max_tokens or ask for a larger budget."
    )
    merged = {"retry-after-ms": str(max(retry_ms, 0)), **headers}
    return QuotaExceededError(
        message, retry_after=retry_ms / 1000, headers=merged, limit="budget", tokens_left=min(tokens_left, default=0)
    )


def report_budget(metrics: GatewayMetrics | None, name: str, limits: EffectiveLimits, used: tuple[int, int]) -> None:
    """Set key `name`'s budget gauges from an admission's answer (`used`: the day's and the month's tokens)."""
    if metrics is not None:
        metrics.set_key_budget(name, limits.daily_tokens, limits.monthly_tokens, *used)
