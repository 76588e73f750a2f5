"""RedisRateLimiter: admission and release of a key's requests (and the renewal of their leases), one Lua script each.

Imports errors, settings, metrics, background, the Redis boundary (gateway.redis), gateway.usage (the counters'
keys and windows), and the package's limiter types, budgets and scripts (ratelimit.lua).
Limits hold across every gateway process sharing Redis; the clock is Redis's `TIME`, never the processes'.
Every Redis call goes through `RedisCalls` (one deadline, one retry on a fresh connection, errors mapped to
KeyStoreUnavailableError).

Admission and release are idempotent per lease id (a short-lived marker key records that the script ran),
so that retry is safe even when a reply, not the command, was lost: a request is never charged twice, and a
release that failed is retried in the background until Redis answers, freeing the slot at once. An admission
that failed (its deadline passed while Redis was stalled) may still run when Redis resumes: its lease id is
released in the background too, and a lease released first is never admitted.

Buckets (requests and tokens) are GCRA in integer arithmetic: one request or token costs `window_ms`
units, a bucket holds `limit * window_ms` units and drains `limit` units per millisecond. Exact integers
(well below 2**53) let a key use precisely 100% of its limit, with no edge bursts and no float drift.

Token budgets are charged in the admission script and reconciled in the release script (ratelimit.budgets), which
also counts the usage for billing (gateway.usage, which reads it back).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import secrets
import time
from collections.abc import Coroutine, Sequence
from datetime import date
from functools import partial
from typing import Any

import redis.asyncio as redis_asyncio

from gateway.background import BackgroundTask, Backoff
from gateway.errors import KeyStoreUnavailableError, RateLimitError, RequestOverLimitError
from gateway.metrics.instruments import GatewayMetrics
from gateway.ratelimit import lua
from gateway.ratelimit.budgets import budget_args, budget_headers, charge_budget, quota_refusal, report_budget
from gateway.ratelimit.limiter import (
    EffectiveLimits,
    Lease,
    LimitedKey,
    TokenDetail,
    format_reset,
    rate_headers,
    rate_limit_error,
)
from gateway.redis import REDIS_ERRORS, DirectScript, RedisCalls
from gateway.settings import Settings
from gateway.usage import (
    LIMITS_PREFIX,
    UNAVAILABLE,
    ApiUsage,
    BudgetUsage,
    BudgetWindows,
    Clock,
    Usage,
    UsageClock,
    UsageReader,
    budget_keys,
    usage_day_key,
    usage_label,
    usage_last_key,
    utc_now,
)

logger = logging.getLogger(__name__)

# Retry-After for a request refused for concurrency: when a slot frees is unknowable, so ask again soon.
_CONCURRENCY_RETRY_MS = 1000

_REFUSED_CONCURRENCY = 1
_REFUSED_REQUESTS = 2
_REFUSED_TOKENS = 4
_REFUSED_TOO_LARGE = 8
_REFUSED_BUDGET = 16
# Refusals a request's size does not change: `precheck` repeats them without Redis until they lapse.
_REFUSED_WITHOUT_BODY = _REFUSED_CONCURRENCY | _REFUSED_REQUESTS
_MAX_REMEMBERED_REFUSALS = 10_000
# Keys whose last admission by this process passed, for `claim_beside`; past the bound the set starts afresh.
_MAX_ADMITTED_KEYS = 10_000
# A failed release is retried this often (jittered) until Redis answers: the slot frees within ~0.5 s of it.
_RELEASE_RETRY = Backoff(initial=0.05, maximum=0.5)
# Failed admissions whose lease ids wait for release, and how many one pipelined round trip releases. Beyond the
# bound (a long outage under load) a lease that did run when Redis resumed expires after `limits.lease_ttl`.
_MAX_UNCONFIRMED = 10_000
_UNCONFIRMED_BATCH = 500


class _LeaseIds:
    """Lease ids unique across processes: 48 random bits drawn once per process (again in a forked child), then a
    counter; `secrets.token_hex` per request was a getrandom system call each."""

    def __init__(self) -> None:
        self._renew()
        os.register_at_fork(after_in_child=self._renew)

    def _renew(self) -> None:
        self._prefix = secrets.token_hex(6)
        self._count = itertools.count()

    def __call__(self) -> str:
        return f"{self._prefix}{next(self._count):x}"


_lease_id = _LeaseIds()


class RedisRateLimiter:
    """The rate limiter shared by every gateway process through Redis: admission, release and lease renewal.

    `start()` runs one task that renews this process's live concurrency slots (pipelined); a slot that is
    not renewed, because its process died, expires after `limits.lease_ttl`.
    """

    def __init__(
        self,
        redis: redis_asyncio.Redis,
        settings: Settings,
        metrics: GatewayMetrics | None = None,
        clock: Clock = utc_now,
    ) -> None:
        self._redis = redis
        self._metrics = metrics
        # The budget windows' clock (aware datetimes); tests move it across midnights instead of waiting for them.
        self._clock = UsageClock(settings.limits.budget_timezone, clock)
        self._usage = UsageReader(redis, settings, self._clock, metrics)
        self._settings = settings.limits
        self._window_ms = max(1, round(settings.limits.window * 1000))
        self._ttl_ms = max(1, round(settings.limits.lease_ttl * 1000))
        self._calls = RedisCalls(settings.redis, metrics)
        # An admission is retried at once, within one call's deadline; a release for as long as its slot lives.
        self._admitted_marker_ms = max(1, round(2 * self._calls.timeout * 1000))
        self._released_marker_ms = self._ttl_ms + 2 * self._admitted_marker_ms
        self._retention_s = settings.limits.usage_retention_days * 86_400
        self._acquire = DirectScript(redis, lua.ACQUIRE)
        self._release = DirectScript(redis, lua.RELEASE)
        self._renew = DirectScript(redis, lua.RENEW)
        self._live: dict[str, Lease] = {}
        self._pending: set[asyncio.Task[Any]] = set()
        self._confirming = 0  # releases written to Redis whose replies are still to come
        self._all_confirmed: asyncio.Future[None] | None = None  # `stop` waits on it for them
        self._retrying: set[BackgroundTask] = set()  # releases that failed, retried until Redis answers
        # Lease id -> (lease, monotonic time to give up) of admissions that failed: released once Redis answers.
        self._unconfirmed: dict[str, tuple[Lease, float]] = {}
        self._unconfirmed_releaser = BackgroundTask(
            "ratelimit-unconfirmed-release",
            self._release_unconfirmed,
            expected=(KeyStoreUnavailableError,),
            backoff=_RELEASE_RETRY,
            stop_timeout=self._calls.timeout + 1,
        )
        # Key name -> (monotonic time the refusal lapses, refused bits, message): `precheck` answers from here.
        self._refusals: dict[str, tuple[float, int, RateLimitError]] = {}
        # Keys Redis admitted the last time this process asked (a refusal or a failure removes one), and those with an
        # admission running beside their request now: `claim_beside`.
        self._overlap = settings.limits.overlap_admission
        self._admitted_keys: set[str] = set()
        self._beside_keys: set[str] = set()
        self._renewer = BackgroundTask.every(
            "ratelimit-lease-renewer",
            settings.limits.lease_renew_interval,
            self._renew_live,
            expected=(KeyStoreUnavailableError,),
            stop_timeout=self._calls.timeout + 1,
        )

    async def start(self) -> None:
        """Start renewing live leases."""
        self._renewer.start()

    async def stop(self) -> None:
        """Stop renewing, give releases in flight one deadline, and stop retrying failed ones (bounded)."""
        await self._renewer.stop()
        if self._confirming:  # a release it finds unconfirmed goes into `_pending`
            self._all_confirmed = asyncio.get_running_loop().create_future()
            await asyncio.wait({self._all_confirmed}, timeout=self._calls.timeout)
        if self._pending:
            await asyncio.wait(set(self._pending), timeout=self._calls.timeout)
        for retry in list(self._retrying):
            await retry.stop()
        self._retrying.clear()
        await self._unconfirmed_releaser.stop()

    def precheck(self, key: LimitedKey) -> None:
        """RateLimitError if `key` was refused for requests/min or concurrency by this process and that refusal
        has not lapsed yet; no Redis call and nothing consumed. For use before the body is read: `acquire`
        still decides (a key this process has not refused passes, and so may the first request after a lapse).
        A concurrency refusal lapses after its Retry-After (1 s) or when this process frees a slot of the key."""
        refusal = self._refusals.get(key.name)
        if refusal is None:
            return
        until, _, error = refusal
        left = until - time.monotonic()
        if left <= 0:
            del self._refusals[key.name]
            return
        retry_ms = max(1, round(left * 1000))
        headers = {name: value for name, value in error.headers.items() if name != "retry-after-ms"}
        raise rate_limit_error(error.message, retry_ms, headers, error.cause or "requests")

    def claim_beside(self, key: LimitedKey) -> bool:
        """Whether `key`'s admission may run while its request is already on its way to the engine
        (`limits.overlap_admission`): only for a key whose last admission by this process passed, and for one request
        of the key at a time (claimed until `end_beside`). A key being refused so costs the engine at most one aborted
        request per process before its requests wait for Redis again. A key with no limits needs no Redis call and
        is never admitted beside."""
        name = key.name
        if not self._overlap or name not in self._admitted_keys or name in self._beside_keys:
            return False
        self._beside_keys.add(name)
        return True

    def end_beside(self, key: LimitedKey) -> None:
        """The admission `claim_beside` allowed has ended (admitted, refused, failed or cancelled)."""
        self._beside_keys.discard(key.name)

    def _note_admission(self, name: str, *, admitted: bool) -> None:
        if not admitted:
            self._admitted_keys.discard(name)
        elif name not in self._admitted_keys:
            if len(self._admitted_keys) >= _MAX_ADMITTED_KEYS:
                self._admitted_keys.clear()
            self._admitted_keys.add(name)

    def effective_limits(self, key: LimitedKey) -> EffectiveLimits:
        """The key's limits with the server defaults filled in (0: unlimited)."""
        own, defaults = key.limits, self._settings
        return EffectiveLimits(
            requests_per_minute=_resolve(own.requests_per_minute, defaults.requests_per_minute),
            tokens_per_minute=_resolve(own.tokens_per_minute, defaults.tokens_per_minute),
            max_concurrency=_resolve(own.max_concurrency, defaults.max_concurrency),
            daily_tokens=_resolve(own.daily_tokens, defaults.daily_tokens),
            monthly_tokens=_resolve(own.monthly_tokens, defaults.monthly_tokens),
        )

    def budget_windows(self) -> BudgetWindows:
        """The budget day and month containing the clock's now, and how long each has left."""
        return self._clock.budget_windows()

    def _utc_today(self) -> date:
        return self._clock.utc_today()

    async def budget_usage(self, name: str) -> BudgetUsage:
        """Tokens `name` used in the current budget day and month (charged estimates of requests in flight too)."""
        return await self._usage.budget_usage(name)

    async def acquire(self, key: LimitedKey, estimated_tokens: int, api: str = "other") -> Lease:
        """A lease for one request of `key` on `api` (the route's API label), charging `estimated_tokens` up
        front; else RateLimitError, or QuotaExceededError for a spent token budget."""
        limits = self.effective_limits(key)
        tokens = max(0, estimated_tokens)
        lease = Lease(key_name=key.name, lease_id=_lease_id(), estimated_tokens=tokens, limits=limits, api=api)
        lease.windows = self.budget_windows()
        if limits.unlimited:
            return lease
        args: list[int | str] = [
            self._window_ms,
            limits.requests_per_minute,
            limits.tokens_per_minute,
            limits.max_concurrency,
            tokens,
            lease.lease_id,
            self._ttl_ms,
            _CONCURRENCY_RETRY_MS,
        ]
        try:
            # Ours: the budget arguments follow the marker's ttl (added by _admit).
            result = await self._admit(key.name, lease, args, budget_args(limits, lease.windows))
        except asyncio.CancelledError:
            # Cancelled while the script was on its way or running: what it may have admitted is given back once
            # Redis answers (the release overtaking a late admission refuses it), as after a Redis failure.
            self._release_unconfirmed_later(lease)
            raise
        except KeyStoreUnavailableError as exc:
            self._release_unconfirmed_later(lease)
            self._admitted_keys.discard(key.name)  # empty unless overlap_admission
            if self._settings.fail_open:
                cause = exc.__cause__ or exc
                logger.warning("Rate-limit store unavailable (%s); admitting without limits", type(cause).__name__)
                lease.degraded = True
                return lease
            raise
        refused, retry_ms, requests_used, tokens_used, day_used, month_used = result
        lease.headers = self._headers(limits, requests_used, tokens_used)
        lease.headers |= budget_headers(limits, day_used, month_used)
        if self._overlap:
            self._note_admission(key.name, admitted=not refused)
        if refused & _REFUSED_BUDGET:
            report_budget(self._metrics, key.name, limits, (day_used, month_used))
            timezone = self._settings.budget_timezone
            raise quota_refusal(limits, tokens, (day_used, month_used), retry_ms, lease.headers, timezone)
        if refused:
            message = self._refusal(refused, limits, tokens, retry_ms)
            # A request over the key's whole per-minute token limit never passes: no SDK should wait to retry it.
            kind = RequestOverLimitError if refused & _REFUSED_TOO_LARGE else RateLimitError
            error = rate_limit_error(message, retry_ms, lease.headers, _exhausted(refused), kind)
            self._remember_refusal(key.name, refused, retry_ms, error)
            raise error
        if limits.max_concurrency:
            self._live[lease.lease_id] = lease
        if limits.daily_tokens or limits.monthly_tokens:
            lease.budget_charged = tokens
            report_budget(self._metrics, key.name, limits, (day_used, month_used))
        return lease

    async def release(
        self, lease: Lease, used_tokens: int | None = None, detail: TokenDetail | None = None, *, served: bool = True
    ) -> None:
        """Reconcile, free the slot and record usage in one script (not `served`: the request is given back to the
        requests/min bucket and left out of the usage). Idempotent, never raises for Redis, and runs to completion
        even if the awaiting request is cancelled.

        Returns once the script is written to Redis, not once Redis has answered: what the caller sends next (the
        answer) reaches its peer after the release reached Redis, so the key's next request finds the slot free
        (on this process's connection it queues behind the release; on another's it arrives later) without the
        answer waiting for a round trip. The reply is checked in the background: a release Redis did not confirm
        (NOSCRIPT, a lost connection) is done again the whole way, retried until Redis answers."""
        if lease.released:
            return
        lease.released = True
        self._live.pop(lease.lease_id, None)
        refusal = self._refusals.get(lease.key_name)
        if refusal is not None and refusal[1] == _REFUSED_CONCURRENCY:
            del self._refusals[lease.key_name]  # a slot of this key frees now
        if lease.degraded:
            return
        keys, args = self._release_call(lease, used_tokens, served=served, detail=detail)
        written = self._release.post(
            keys, args, partial(self._confirmed, lease.key_name, keys, args, time.perf_counter())
        )
        if written is not None:
            self._confirming += 1
            await written  # a cancel here leaves the release queued, its reply still checked
            return
        try:  # no connection yet: the whole way (it connects)
            await self._finish(lease.key_name, keys, args)
        except asyncio.CancelledError:
            # The script may be written already, or not: the release runs once more to its end in the background
            # (a second release of a lease changes nothing).
            _ = self._spawn(self._finish(lease.key_name, keys, args))
            raise

    def _confirmed(self, name: str, keys: list[str], args: list[int | str], started: float, reply: object) -> None:
        """A posted release's reply (an exception: an error reply or the connection's loss), in the lane's data
        callback: a release Redis did not confirm is done again the whole way."""
        self._confirming -= 1
        if not self._confirming and self._all_confirmed is not None and not self._all_confirmed.done():
            self._all_confirmed.set_result(None)
        if not isinstance(reply, BaseException):
            self._calls.succeeded(started)
            return
        _ = self._spawn(self._finish(name, keys, args))

    async def usage(self, names: Sequence[str], day: date | None = None) -> dict[str, Usage]:
        """Requests and tokens of each key on `day` (UTC, default today) and when each was last used."""
        return await self._usage.usage(names, day)

    async def usage_by_api(self, names: Sequence[str], since: date, until: date | None = None) -> list[ApiUsage]:
        """Each key's usage by UTC day, API and model from `since` to `until` (default today), days without use left
        out."""
        return await self._usage.usage_by_api(names, since, until)

    async def _admit(
        self, name: str, lease: Lease, args: list[int | str], budget_args: list[int | str]
    ) -> tuple[int, int, int, int, int, int]:
        assert lease.windows is not None
        keys = [
            *_bucket_keys(name),
            _marker_key(name, "admitted", lease.lease_id),
            _marker_key(name, "released", lease.lease_id),
            *budget_keys(name, lease.windows),
        ]
        full_args = [*args, self._admitted_marker_ms, *budget_args]
        result = await self._calls(lambda: self._acquire(keys=keys, args=full_args), unavailable=UNAVAILABLE)
        refused, retry_ms, requests_used, tokens_used, day_used, month_used = (int(value) for value in result)
        return refused, retry_ms, requests_used, tokens_used, day_used, month_used

    def _release_unconfirmed_later(self, lease: Lease) -> None:
        # The admission's script may still be queued in a stalled Redis and run when it resumes; its slot would
        # then be held until the lease TTL. Released (idempotently) once Redis answers, in one background task.
        limits = lease.limits
        if not (limits.max_concurrency or limits.tokens_per_minute or limits.daily_tokens or limits.monthly_tokens):
            return  # nothing the admission could hold or charge that a release gives back
        if len(self._unconfirmed) >= _MAX_UNCONFIRMED:
            return
        charge_budget(lease)  # refunded only if the admission ran (the release script checks its marker)
        self._unconfirmed[lease.lease_id] = (lease, time.monotonic() + self._settings.lease_ttl)
        self._unconfirmed_releaser.start()

    async def _release_unconfirmed(self) -> None:
        while self._unconfirmed:
            now = time.monotonic()
            for lease_id in [i for i, (_, until) in self._unconfirmed.items() if until <= now]:
                del self._unconfirmed[lease_id]  # past its TTL the slot has expired in Redis anyway
            batch = [lease for lease, _ in list(self._unconfirmed.values())[:_UNCONFIRMED_BATCH]]
            if not batch:
                return
            calls = [self._release_call(lease, 0, served=False, unconfirmed=True) for lease in batch]

            async def release_all(calls: list[tuple[list[str], list[int | str]]] = calls) -> None:
                async with self._redis.pipeline(transaction=False) as pipe:  # reset even when cancelled
                    for keys, args in calls:
                        await self._release(keys=keys, args=args, client=pipe)
                    await pipe.execute()

            await self._calls(release_all, unavailable=UNAVAILABLE)
            for lease in batch:
                self._unconfirmed.pop(lease.lease_id, None)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(work)
        self._pending.add(task)  # a reference until done; stop() waits for these
        task.add_done_callback(self._pending.discard)
        return task

    def _remember_refusal(self, name: str, refused: int, retry_ms: int, error: RateLimitError) -> None:
        if refused & ~_REFUSED_WITHOUT_BODY:
            return  # a token refusal depends on the request's size: a smaller one may pass
        now = time.monotonic()
        if len(self._refusals) >= _MAX_REMEMBERED_REFUSALS:
            self._refusals = {name: refusal for name, refusal in self._refusals.items() if refusal[0] > now}
            if len(self._refusals) >= _MAX_REMEMBERED_REFUSALS:
                return
        self._refusals[name] = (now + retry_ms / 1000, refused, error)

    def _headers(self, limits: EffectiveLimits, requests_used: int, tokens_used: int) -> dict[str, str]:
        headers: dict[str, str] = {}
        if limits.requests_per_minute:
            headers |= rate_headers("requests", limits.requests_per_minute, self._window_ms, requests_used)
        if limits.tokens_per_minute:
            headers |= rate_headers("tokens", limits.tokens_per_minute, self._window_ms, tokens_used)
        return headers

    def _refusal(self, refused: int, limits: EffectiveLimits, tokens: int, retry_ms: int) -> str:
        period = "minute" if self._window_ms == 60_000 else f"{self._window_ms / 1000:g} s"
        reasons = []
        if refused & _REFUSED_CONCURRENCY:
            reasons.append(f"too many requests in flight for this key (limit {limits.max_concurrency})")
        if refused & _REFUSED_REQUESTS:
            reasons.append(f"requests per {period} (limit {limits.requests_per_minute})")
        if refused & _REFUSED_TOKENS:
            reasons.append(f"tokens per {period} (limit {limits.tokens_per_minute}, requested {tokens})")
        if refused & _REFUSED_TOO_LARGE:
            return (
                f"Request too large: about {tokens} tokens (prompt estimate + max_tokens) exceed this key's "
                f"limit of {limits.tokens_per_minute} tokens per {period}; lower max_tokens or shorten the prompt."
            )
        return f"Rate limit reached: {'; '.join(reasons)}. Retry in {format_reset(retry_ms)}."

    def _release_call(
        self,
        lease: Lease,
        used_tokens: int | None,
        *,
        served: bool,
        unconfirmed: bool = False,
        detail: TokenDetail | None = None,
    ) -> tuple[list[str], list[int | str]]:
        """The RELEASE script's keys and arguments for `lease` (see `lua.RELEASE`)."""
        used = lease.estimated_tokens if used_tokens is None else max(0, used_tokens)
        today = self._utc_today()
        windows = lease.windows or self.budget_windows()
        detail = detail or TokenDetail()
        keys = [
            *_bucket_keys(lease.key_name),
            usage_day_key(lease.key_name, today),
            usage_last_key(lease.key_name),
            _marker_key(lease.key_name, "released", lease.lease_id),
            _marker_key(lease.key_name, "admitted", lease.lease_id),
            *budget_keys(lease.key_name, windows),
        ]
        args: list[int | str] = [
            self._window_ms,
            lease.limits.tokens_per_minute,
            used - lease.estimated_tokens,
            lease.lease_id,
            used,
            self._retention_s,
            1 if served else 0,
            self._released_marker_ms,
            1 if unconfirmed else 0,
            used - lease.budget_charged,
            windows.day_left_ms,
            windows.month_left_ms,
            usage_label(lease.api, detail.model),
            *(-1 if count is None else count for count in (detail.prompt, detail.completion, detail.reasoning)),
            lease.limits.requests_per_minute,
        ]
        return keys, args

    async def _finish(self, name: str, keys: list[str], args: list[int | str]) -> None:
        """The release script, awaited (retried once on a fresh connection); if Redis does not answer, retried in the
        background until it does."""
        try:
            await self._calls(lambda: self._release(keys=keys, args=args), unavailable=UNAVAILABLE)
            return
        except KeyStoreUnavailableError as exc:
            logger.warning(
                "Could not release a lease of key %s (%s); retrying until Redis answers",
                name,
                type(exc.__cause__ or exc).__name__,
            )
        self._retry_release(name, keys, args)

    def _retry_release(self, name: str, keys: list[str], args: list[int | str]) -> None:
        # Past the lease's TTL its slot has expired in Redis anyway; the marker makes a late success harmless.
        give_up = time.monotonic() + self._settings.lease_ttl

        async def once() -> None:
            if time.monotonic() > give_up:
                logger.warning("Gave up releasing a lease of key %s; its slot has expired", name)
                return
            await self._calls(lambda: self._release(keys=keys, args=args), unavailable=UNAVAILABLE)
            logger.info("Released a lease of key %s after Redis came back", name)

        self._retrying = {retry for retry in self._retrying if retry.running}
        retry = BackgroundTask(
            f"ratelimit-release:{name}",
            once,
            expected=REDIS_ERRORS,
            backoff=_RELEASE_RETRY,
            stop_timeout=self._calls.timeout + 1,
        )
        retry.start()
        self._retrying.add(retry)

    async def _renew_live(self) -> None:
        by_key: dict[str, list[str]] = {}
        for lease in self._live.values():
            by_key.setdefault(lease.key_name, []).append(lease.lease_id)
        if not by_key:
            return

        async def renew() -> list[list[bytes]]:
            async with self._redis.pipeline(transaction=False) as pipe:  # reset even when cancelled
                for name, ids in by_key.items():
                    await self._renew(keys=[_bucket_keys(name)[2]], args=[self._ttl_ms, *ids], client=pipe)
                results: list[list[bytes]] = await pipe.execute()
                return results

        try:
            results = await self._calls(renew, unavailable=UNAVAILABLE)
        except KeyStoreUnavailableError as exc:
            cause = exc.__cause__ or exc
            logger.warning("Could not renew %d concurrency slots (%s)", len(self._live), type(cause).__name__)
            return
        for lost in results:
            for lease_id in lost:
                gone = self._live.pop(lease_id.decode(), None)
                if gone is not None:
                    logger.warning("A concurrency slot of key %s expired before it was renewed", gone.key_name)


def _resolve(own: int | None, default: int | None) -> int:
    if own is None:
        return default or 0
    return own


def _bucket_keys(name: str) -> list[str]:
    # `{name}` is a hash tag: a key's buckets, leases and usage share one Redis Cluster slot.
    return [f"{LIMITS_PREFIX}{{{name}}}:req", f"{LIMITS_PREFIX}{{{name}}}:tok", f"{LIMITS_PREFIX}{{{name}}}:lease"]


def _exhausted(refused: int) -> str:
    """The limit a refusal is counted under (`nemotron_gateway_rate_limited_total{limit}`): the first that applies."""
    if refused & _REFUSED_CONCURRENCY:
        return "concurrency"
    if refused & _REFUSED_REQUESTS:
        return "requests"
    return "tokens"


def _marker_key(name: str, kind: str, lease_id: str) -> str:
    return f"{LIMITS_PREFIX}{{{name}}}:{kind}:{lease_id}"
