"""EngineAdmission: refuses new work before vLLM's queue once it is full, lowest priority first, across every
gateway sharing Redis.

What the engine carries comes from vLLM's own gauges, read by each worker's engine monitor and published to
Redis with `mark`: the value of the gateways' shared admission counter `TRANSIT` before that scrape. A request is
judged by one Lua script (one round trip) against the newest scrape plus every admission counted since its
mark, so a burst between two scrapes cannot overshoot the bound, whichever worker or host admits it. It is
kept out of the per-key limiter's script on purpose: that one's keys carry the key's hash tag, these are one
per engine, and a Redis Cluster runs a script on the keys of one slot only. A scrape not refreshed
for 30 intervals (at least 60 s) expires, and without one nothing is refused: the engine monitor answers for a
down engine.

The tier rule: priority p is in tier min(p, len(shares) - 1); it is refused with 429 once waiting requests
reach max(1, max_waiting x shares[tier]), and with 503 once the KV-cache use reaches max_kv_cache_use x
shares[tier]. With `reserved_seqs` set, a tier below 0 is also refused with 429 once the engine holds (runs,
queues, or was admitted since the scrape) its sequence slots less the reserve: vLLM hands a slot to a waiting
request only when a running one ends, so without free slots an urgent request waits behind a batch generation.
Retry-After is the time the observed drain rate (requests finished per second) takes to bring the count back
under the tier's bound, between 1 s and `max_retry_after`.
Imports errors, settings, metrics and gateway.redis.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import redis.asyncio as redis_asyncio
from prometheus_client import Counter

from gateway.engine.supervisor_state import STATUS_FILE, launched_sequence_slots
from gateway.errors import EngineBusyError, EngineQueueFullError, GatewayError, KeyStoreUnavailableError
from gateway.metrics.instruments import GatewayMetrics
from gateway.redis import DirectScript, RedisCalls
from gateway.settings import AdmissionSettings, Settings

logger = logging.getLogger(__name__)

_PREFIX = "nemotron:admission:"
_UNAVAILABLE = "The admission store is unavailable; retry shortly."
# A published scrape lives this many scrape intervals (at least `_MIN_TTL_MS`): a gateway that stopped
# scraping (engine down, every worker gone) must not leave a stale queue refusing work, yet a saturated engine's
# /metrics often outlasts the probe timeout, and a scrape that expired after a few such misses let every request
# in (on the H200, 3,014 batch requests admitted against a bound of 240 held). Kept longer, the last scrape plus
# every admission counted since it errs on the safe side until a scrape gets through.
_SCRAPES_KEPT = 30
_MIN_TTL_MS = 60_000
# Seconds between taking the mark and scraping: a request admitted just before the mark has this long to reach
# the engine and show in its gauges (one admitted within it is counted twice until the next scrape: on the
# safe side).
TRANSIT = 0.05

# Seconds between two reads of the supervisor's status file for the engine's sequence slots, per worker.
_SLOTS_REREAD = 2.0

ADMITTED, REFUSED_WAITING, REFUSED_KV_CACHE, REFUSED_SLOTS = 0, 1, 2, 3

# KEYS: the load record (HASH: waiting, running, kv, mark, drain), the admission counter.
# ARGV: the tier's bound on waiting requests, on KV-cache use, on requests held (running + waiting); -1: off.
# Returns {outcome, requests counted against the bound that refused (waiting, else held), drain rate as text}.
ADMIT = """
local load = redis.call('HMGET', KEYS[1], 'waiting', 'kv', 'mark', 'drain', 'running')
if not load[1] then
  redis.call('INCR', KEYS[2])
  return {0, 0, '0'}
end
local counted = tonumber(redis.call('GET', KEYS[2]) or '0')
local waiting = tonumber(load[1]) + math.max(0, counted - tonumber(load[3]))
local held = waiting + tonumber(load[5] or '0')
local kv_bound, waiting_bound, held_bound = tonumber(ARGV[2]), tonumber(ARGV[1]), tonumber(ARGV[3])
if kv_bound >= 0 and tonumber(load[2]) >= kv_bound then return {2, waiting, load[4]} end
if waiting_bound >= 0 and waiting >= waiting_bound then return {1, waiting, load[4]} end
if held_bound >= 0 and held >= held_bound then return {3, held, load[4]} end
redis.call('INCR', KEYS[2])
return {0, waiting + 1, load[4]}
"""

# KEYS: the load record, the admission counter. ARGV: waiting, kv, mark, drain, ttl ms, running.
# A scrape whose mark is older than the one published (another worker's newer scrape) is dropped.
PUBLISH = """
local published = tonumber(redis.call('HGET', KEYS[1], 'mark') or '-1')
if tonumber(ARGV[3]) < published then return 0 end
redis.call('HSET', KEYS[1], 'waiting', ARGV[1], 'kv', ARGV[2], 'mark', ARGV[3], 'drain', ARGV[4], 'running', ARGV[6])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return 1
"""


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What one scrape of vLLM's /metrics says about its load."""

    waiting: float
    running: float
    kv_cache_use: float
    finished: float  # requests finished so far (a counter): the drain rate is its growth


def _series(name: str) -> re.Pattern[str]:
    return re.compile(rf"^vllm:{name}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", re.MULTILINE)


# vLLM's names (vllm/v1/metrics/loggers.py, 0.26 and 0.32); gpu_cache_usage_perc is the older KV-cache name.
_WAITING = _series("num_requests_waiting")
_RUNNING = _series("num_requests_running")
_KV_CACHE = _series("(?:kv|gpu)_cache_usage_perc")
_FINISHED = _series("request_success_total")


def parse_load(text: str) -> EngineLoad | None:
    """The load gauges summed over their labels (engines, finish reasons; the KV cache as the fullest engine);
    None when the text has no waiting gauge (not vLLM's /metrics)."""
    waiting = _WAITING.findall(text)
    if not waiting:
        return None
    return EngineLoad(
        waiting=sum(map(float, waiting)),
        running=sum(map(float, _RUNNING.findall(text))),
        kv_cache_use=max(map(float, _KV_CACHE.findall(text)), default=0.0),
        finished=sum(map(float, _FINISHED.findall(text))),
    )


@dataclass(frozen=True, slots=True)
class TierBounds:
    """The bounds that apply to one priority tier (None: that bound is off)."""

    tier: int
    waiting: int | None
    kv_cache_use: float | None
    held: int | None = None  # requests the engine may hold (running + waiting) before this tier is refused


def tier_of(priority: int, settings: AdmissionSettings) -> int:
    """The tier of `priority`: its index in `shares`, the last share for every larger priority."""
    return min(max(priority, 0), len(settings.shares) - 1)


def tier_bounds(priority: int, settings: AdmissionSettings, sequence_slots: int | None = None) -> TierBounds:
    """The bounds of `priority`'s tier: the full bounds for tier 0, `shares[tier]` of them below (at least one
    waiting request, so that every tier is served while the queue is short); below tier 0, with `reserved_seqs`
    and the engine's `sequence_slots` known, at most that many slots less the reserve held (at least one)."""
    tier = tier_of(priority, settings)
    share = settings.shares[tier]
    waiting = None if settings.max_waiting is None else max(1, math.floor(settings.max_waiting * share))
    kv = None if settings.max_kv_cache_use is None else settings.max_kv_cache_use * share
    held = None
    if tier > 0 and settings.reserved_seqs is not None and sequence_slots is not None:
        held = max(1, sequence_slots - settings.reserved_seqs)
    return TierBounds(tier=tier, waiting=waiting, kv_cache_use=kv, held=held)


def retry_after(waiting: float, bound: int, drain: float, settings: AdmissionSettings) -> float:
    """Seconds until `drain` requests/s bring `waiting` below `bound`, within [1, max_retry_after]; the longest
    when nothing is seen draining."""
    if drain <= 0:
        return settings.max_retry_after
    return min(settings.max_retry_after, max(1.0, (waiting - bound + 1) / drain))


def engine_id(settings: Settings, url: str | None = None) -> str:
    """What names the engine at `url` (default: `engine_url`) in Redis: for `engine_url`, the setting where one is
    given; else this host and the URL for an engine on this host (gateways on other hosts share the counter only
    when they front the same engine and say so with NEMOTRON_ADMISSION__ENGINE_ID), and the URL alone for a replica
    elsewhere (every gateway that routes to it names it alike)."""
    url = url or settings.engine_url
    if url == settings.engine_url and settings.admission.engine_id:
        return settings.admission.engine_id
    host = urlsplit(url).hostname or ""
    if host in ("127.0.0.1", "localhost", "::1") or host.startswith("127."):
        return f"{socket.gethostname()}|{url}"
    return url


class EngineAdmission:
    """Admits a request against the engine's load (Redis), and publishes what the engine monitor scrapes."""

    def __init__(
        self,
        redis: redis_asyncio.Redis,
        settings: Settings,
        metrics: GatewayMetrics,
        *,
        url: str | None = None,
        state_dir: Path | None = None,
    ) -> None:
        """The admission of the engine at `url` (default: `engine_url`), whose supervisor writes its status in
        `state_dir` (None: `engine.state_dir` for `engine_url`, no status file for another engine)."""
        self._settings = settings.admission
        self._fail_open = settings.limits.fail_open
        self._metrics = metrics
        self._calls = RedisCalls(settings.redis, metrics)
        self.replica = url or settings.engine_url
        # The model the engine serves, for the load gauges' label (the pool points this at its monitor's).
        self.model_name: Callable[[], str] = lambda: ""
        name = engine_id(settings, url)
        self._keys = [f"{_PREFIX}{{{name}}}:load", f"{_PREFIX}{{{name}}}:admitted"]
        self._admit = DirectScript(redis, ADMIT)
        self._publish = DirectScript(redis, PUBLISH)
        self._redis = redis
        self._last: tuple[float, float] | None = None  # (monotonic time, finished) of this worker's last scrape
        self._drain = 0.0  # requests finished per second between this worker's last two scrapes
        self._warned = False
        # The engine's sequence slots, for `reserved_seqs`: the setting, else the supervisor's status file, read by
        # every worker at its admissions (at most every `_SLOTS_REREAD` s: a restarted engine may have been launched
        # with another --max-num-seqs). Not at the scrape: only the worker holding the probe turn scrapes, and the
        # other workers then admitted without any reserve (on the H200, 1,878 batch requests past 240 held).
        self._slots = self._settings.sequence_slots
        self._slots_read_at = -_SLOTS_REREAD
        if state_dir is None and self.replica == settings.engine_url:
            state_dir = settings.engine.state_dir
        self._status_file = None if state_dir is None else state_dir / STATUS_FILE
        self._warned_slots = False
        self._ttl_ms = max(_MIN_TTL_MS, int(_SCRAPES_KEPT * settings.relay.probe_interval * 1000))
        # The sent counters of each model the engine served, looked up once (labels() per request shows in a
        # profile); made with every tier's refusal series, at 0, so rates and the dashboard's panels have data.
        self._sent: dict[str, dict[tuple[int, bool], Counter]] = {}

    @property
    def enabled(self) -> bool:
        """Whether any bound is set."""
        return self._settings.enabled

    async def admit(self, priority: int) -> None:
        """Count the request in, or raise EngineQueueFullError (429) / EngineBusyError (503) with Retry-After."""
        if not self._settings.enabled:
            return
        if self._settings.reserved_seqs is not None and self._settings.sequence_slots is None:
            self._read_sequence_slots()
        bounds = tier_bounds(priority, self._settings, self._slots)
        args = [
            -1 if bounds.waiting is None else bounds.waiting,
            -1 if bounds.kv_cache_use is None else repr(bounds.kv_cache_use),
            -1 if bounds.held is None else bounds.held,
        ]
        try:
            outcome, waiting, drain_text = await self._calls(
                lambda: self._admit(keys=self._keys, args=args), unavailable=_UNAVAILABLE
            )
        except KeyStoreUnavailableError:
            if self._fail_open:  # NEMOTRON_LIMITS__FAIL_OPEN: Redis down admits, as for the key's limits
                return
            raise
        if outcome == ADMITTED:
            return
        drain = float(drain_text)
        tier = str(bounds.tier)
        if outcome == REFUSED_KV_CACHE:
            self._count_refused(tier, "kv_cache")
            raise EngineBusyError(
                "The model engine's KV cache is full for this priority; retry shortly.",
                retry_after=retry_after(1, 1, drain, self._settings),
            )
        if outcome == REFUSED_SLOTS:
            self._count_refused(tier, "slots")
            held_bound = bounds.held or 1
            raise EngineQueueFullError(
                f"The model engine's free sequence slots are kept for more urgent work ({int(waiting)} requests "
                f"held, bound {held_bound} for this priority); retry after the Retry-After seconds.",
                retry_after=retry_after(waiting, held_bound, drain, self._settings),
                limit="engine_queue",
            )
        self._count_refused(tier, "waiting")
        bound = bounds.waiting or 1
        raise EngineQueueFullError(
            f"The model engine's queue is full for this priority ({int(waiting)} waiting, bound {bound}); "
            "retry after the Retry-After seconds.",
            retry_after=retry_after(waiting, bound, drain, self._settings),
            limit="engine_queue",
        )

    def count_sent(self, priority: int, *, sent: bool) -> None:
        """Count a request going to the engine at `priority`, with vLLM's `priority` field or without (FCFS)."""
        self._sent_counters()[tier_of(priority, self._settings), sent].inc()

    def _sent_counters(self) -> dict[tuple[int, bool], Counter]:
        """The sent counters of the model the engine serves now (the first time: its series, all at 0)."""
        model = self.model_name()
        counters = self._sent.get(model)
        if counters is None:
            metrics, replica, tiers = self._metrics, self.replica, range(len(self._settings.shares))
            for tier in tiers:
                for reason in ("waiting", "kv_cache", "slots"):
                    metrics.admission_refused.labels(replica, model, str(tier), reason)
            metrics.admission_refused.labels(replica, model, "all", "engine_queue")
            counters = self._sent[model] = {
                (tier, sent): metrics.priority_sent.labels(replica, model, str(tier), "sent" if sent else "dropped")
                for tier in tiers
                for sent in (True, False)
            }
        return counters

    def _count_refused(self, tier: str, reason: str) -> None:
        """Count a request refused before the engine's queue, at `tier` (`all`: by vLLM's own queue bound)."""
        self._metrics.admission_refused.labels(self.replica, self.model_name(), tier, reason).inc()

    async def observe(self, scrape: Callable[[], Awaitable[str]]) -> EngineLoad | None:
        """Scrape the engine's /metrics with `scrape` (the engine monitor's, on its interval), export its load and,
        with a bound set, publish it; the load read (None: none). A failed scrape or Redis call is logged and leaves
        the last one to expire."""
        try:
            mark = await self.mark() if self.enabled else 0
            if self.enabled:
                await asyncio.sleep(TRANSIT)
            load = parse_load(await scrape())
            if load is None:
                if not self._warned:
                    self._warned = True
                    logger.warning("the engine's /metrics has no vllm:num_requests_waiting; admission sees no load")
                return None
            await self.publish(load, mark, time.monotonic())
            return load
        except GatewayError as exc:
            logger.debug("engine load not published: %s", exc.message)
            return None

    def _read_sequence_slots(self) -> None:
        """The launched engine's sequence slots from the supervisor's status file (a small local file, read in the
        event loop at most every `_SLOTS_REREAD` s); warned about once if unknown."""
        now = time.monotonic()
        if now - self._slots_read_at < _SLOTS_REREAD:
            return
        self._slots_read_at = now
        self._slots = None if self._status_file is None else launched_sequence_slots(self._status_file)
        if self._slots is None and not self._warned_slots:
            self._warned_slots = True
            logger.warning(
                "NEMOTRON_ADMISSION__RESERVED_SEQS is set but the engine's sequence slots are unknown (no "
                "--max-num-seqs in the supervisor's status file): no slots are reserved; set "
                "NEMOTRON_ADMISSION__SEQUENCE_SLOTS"
            )

    async def mark(self) -> int:
        """The admission counter now: taken just before a scrape, what was admitted after it counts as pending."""
        raw = await self._calls(lambda: self._redis.get(self._keys[1]), unavailable=_UNAVAILABLE)
        return int(raw or 0)

    async def publish(self, load: EngineLoad, mark: int, now: float) -> None:
        """Export the load and this worker's drain rate; with a bound set, publish them (`mark` from `mark()`)."""
        drain = 0.0
        if self._last is not None and now > self._last[0]:
            drain = max(0.0, (load.finished - self._last[1]) / (now - self._last[0]))
        self._last = (now, load.finished)
        self._drain = drain
        model = self.model_name()
        if model:
            self._sent_counters()  # the model's series exist (at 0) from its first scrape
        for figure, value in (
            ("waiting", load.waiting),
            ("running", load.running),
            ("kv_cache_use", load.kv_cache_use),
            ("drain_per_second", drain),
        ):
            self._metrics.engine_load.labels(self.replica, model, figure).set(value)
        if not self.enabled:
            return
        args: list[str | int] = [
            repr(load.waiting),
            repr(load.kv_cache_use),
            mark,
            repr(drain),
            self._ttl_ms,
            repr(load.running),
        ]
        await self._calls(lambda: self._publish(keys=self._keys, args=args), unavailable=_UNAVAILABLE)
