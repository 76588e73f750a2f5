"""What each API key has used, as the rate limiter counts it in Redis: the counters' keys, the budget windows, and
reading them back.

The limiter's release script (gateway.ratelimit) writes these counters when a request ends; the `keys` CLI
(gateway.auth) reads them. Both import this module, which sits below them and imports settings, metrics and the Redis
boundary (gateway.redis) only. Usage for billing is counted by UTC day, by API (the route's API label: chat,
completions, responses, messages) and by the model that served it; token budgets (daily and monthly, in
`limits.budget_timezone`) are plain counters per window, whose windows come from an injectable clock (tests move it
across midnights instead of waiting).
"""

from __future__ import annotations

import math
import time
import zoneinfo
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from datetime import time as day_start
from functools import lru_cache
from typing import Any, Final

import redis.asyncio as redis_asyncio

from gateway.metrics.instruments import GatewayMetrics
from gateway.redis import RedisCalls
from gateway.settings import Settings

# The rate limiter's keys (budgets among them) and the usage counters' keys. `{name}` is a hash tag: a key's buckets,
# leases, budgets and usage share one Redis Cluster slot, so one script can touch them all.
LIMITS_PREFIX: Final = "nemotron:rl:"
USAGE_PREFIX: Final = "nemotron:usage:"
UNAVAILABLE: Final = "The rate-limit store is unavailable; retry shortly."
_USAGE_KINDS = ("requests", "tokens", "prompt_tokens", "completion_tokens", "reasoning_tokens")

Clock = Callable[[], datetime]


@dataclass(frozen=True, slots=True)
class BudgetWindows:
    """The token budget windows a request is charged to: their Redis ids and milliseconds until each ends."""

    day: str
    month: str
    day_left_ms: int
    month_left_ms: int


@dataclass(frozen=True, slots=True)
class Usage:
    """A key's usage on one (UTC) day, and when it was last used (any day)."""

    day: date
    requests: int
    tokens: int
    last_used: datetime | None


@dataclass(frozen=True, slots=True)
class ApiUsage:
    """One key's usage of one API and one model on one UTC day, for billing: `tokens` is what was charged (the
    engine's prompt + completion, or the up-front estimate where the engine reported no usage); `model` is "" for
    usage recorded without one (before the gateway named it)."""

    name: str
    day: date
    api: str
    model: str
    requests: int
    tokens: int
    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int


@dataclass(frozen=True, slots=True)
class BudgetUsage:
    """Tokens a key used in the current budget windows (day and month, `limits.budget_timezone`)."""

    day: int
    month: int
    windows: BudgetWindows


def utc_now() -> datetime:
    """The default clock: now, in UTC."""
    return datetime.now(UTC)


def budget_keys(name: str, windows: BudgetWindows) -> list[str]:
    """The day and month budget counters of key `name`."""
    return [f"{LIMITS_PREFIX}{{{name}}}:budget:{windows.day}", f"{LIMITS_PREFIX}{{{name}}}:budget:{windows.month}"]


def usage_day_key(name: str, day: date) -> str:
    """The hash of key `name`'s usage on UTC `day`, by API, model and kind (`chat|nemotron:tokens`: see
    `usage_label`) and in total (`tokens`)."""
    return f"{USAGE_PREFIX}{{{name}}}:{_day_text(day)}"


# Between the API and the model in a usage field's label: in neither an API label nor a model name.
_MODEL_SEPARATOR: Final = "|"


def usage_label(api: str, model: str | None) -> str:
    """The label of a request's usage fields (`LABEL:requests`, `LABEL:tokens`, ...): its API and its model."""
    return f"{api}{_MODEL_SEPARATOR}{model}" if model else api


def _api_and_model(label: str) -> tuple[str, str]:
    api, _, model = label.partition(_MODEL_SEPARATOR)
    return api, model


def usage_last_key(name: str) -> str:
    """When key `name` was last used (epoch milliseconds)."""
    return f"{USAGE_PREFIX}{{{name}}}:last"


@lru_cache(maxsize=8)
def _day_text(day: date) -> str:
    # Every release names today's usage key: strftime took 3.5 µs a call here, the cached text 0.15 µs.
    return f"{day:%Y%m%d}"


@lru_cache(maxsize=8)
def _utc_date(day_number: int) -> date:
    return date(1970, 1, 1) + timedelta(days=day_number)


class UsageClock:
    """The budget windows and the usage day at the clock's now (`clock`: aware datetimes, `utc_now` by default)."""

    def __init__(self, budget_timezone: str, clock: Clock = utc_now) -> None:
        self._clock = clock
        self._zone = zoneinfo.ZoneInfo(budget_timezone)
        # The current budget day: its start and end, the month's end, and their ids.
        self._bounds: tuple[float, float, float, str, str] | None = None

    def budget_windows(self) -> BudgetWindows:
        """The budget day and month containing the clock's now, and how long each has left."""
        now = time.time() if self._clock is utc_now else self._clock().timestamp()
        bounds = self._bounds
        if bounds is None or not bounds[0] <= now < bounds[1]:
            # Time-zone arithmetic costs ~30 us: done once per day, not per request (bounds kept as epoch seconds).
            local = datetime.fromtimestamp(now, self._zone)
            today = datetime.combine(local.date(), day_start(), self._zone)
            next_day = datetime.combine(local.date() + timedelta(days=1), day_start(), self._zone)
            first = local.date().replace(day=1)
            next_month = datetime.combine((first + timedelta(days=32)).replace(day=1), day_start(), self._zone)
            edges = (today.timestamp(), next_day.timestamp(), next_month.timestamp())
            bounds = self._bounds = (*edges, f"d{local:%Y%m%d}", f"m{local:%Y%m}")
        _, next_day_at, next_month_at, day, month = bounds
        return BudgetWindows(
            day=day,
            month=month,
            day_left_ms=max(1, math.ceil((next_day_at - now) * 1000)),
            month_left_ms=max(1, math.ceil((next_month_at - now) * 1000)),
        )

    def utc_today(self) -> date:
        """The clock's UTC date (the usage keys' day): for the default clock, the day's number from the epoch
        seconds, its date cached (a datetime and a time-zone conversion cost ~2 µs a release)."""
        if self._clock is not utc_now:
            return self._clock().astimezone(UTC).date()
        return _utc_date(int(time.time() // 86_400))


class UsageReader:
    """Reads the usage counters and budget counters of keys (every call through `RedisCalls`)."""

    def __init__(
        self,
        redis: redis_asyncio.Redis,
        settings: Settings,
        clock: UsageClock | None = None,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self._redis = redis
        self._calls = RedisCalls(settings.redis, metrics)
        self._clock = clock or UsageClock(settings.limits.budget_timezone)

    async def usage(self, names: Sequence[str], day: date | None = None) -> dict[str, Usage]:
        """Requests and tokens of each key on `day` (UTC, default today) and when each was last used."""
        day = day or datetime.now(UTC).date()

        async def read() -> list[Any]:
            async with self._redis.pipeline(transaction=False) as pipe:
                for name in names:
                    _ = pipe.hmget(usage_day_key(name, day), ["requests", "tokens"])
                    _ = pipe.get(usage_last_key(name))
                return await pipe.execute() if names else []

        results = await self._calls(read, unavailable=UNAVAILABLE)
        usage: dict[str, Usage] = {}
        for index, name in enumerate(names):
            (requests, tokens), last = results[2 * index], results[2 * index + 1]
            usage[name] = Usage(
                day=day,
                requests=int(requests or 0),
                tokens=int(tokens or 0),
                last_used=datetime.fromtimestamp(int(last) / 1000, UTC) if last else None,
            )
        return usage

    async def usage_by_api(self, names: Sequence[str], since: date, until: date | None = None) -> list[ApiUsage]:
        """Each key's usage by UTC day, API and model from `since` to `until` (default today), days without use left
        out."""
        until = until or self._clock.utc_today()
        days = [since + timedelta(days=offset) for offset in range(max(0, (until - since).days + 1))]

        async def read() -> list[Any]:
            async with self._redis.pipeline(transaction=False) as pipe:
                for name in names:
                    for day in days:
                        _ = pipe.hgetall(usage_day_key(name, day))
                return await pipe.execute() if names and days else []

        results = iter(await self._calls(read, unavailable=UNAVAILABLE))
        rows: list[ApiUsage] = []
        for name in names:
            for day in days:
                counts = {field.decode(): int(value) for field, value in next(results).items()}
                labels = {field.rsplit(":", 1)[0] for field in counts if ":" in field}
                for label in sorted(labels, key=_api_and_model):
                    by_kind = {kind: counts.get(f"{label}:{kind}", 0) for kind in _USAGE_KINDS}
                    api, model = _api_and_model(label)
                    rows.append(ApiUsage(name=name, day=day, api=api, model=model, **by_kind))
        return rows

    async def budget_usage(self, name: str) -> BudgetUsage:
        """Tokens `name` used in the current budget day and month (charged estimates of requests in flight too)."""
        windows = self._clock.budget_windows()
        keys = budget_keys(name, windows)
        day, month = await self._calls(lambda: self._redis.mget(keys), unavailable=UNAVAILABLE)
        return BudgetUsage(day=int(day or 0), month=int(month or 0), windows=windows)
