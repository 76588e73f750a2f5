"""ResponseStore: the Responses API's stored state in Redis, owned by the key that made each response.

A stored response is one Redis hash, `nemotron:resp:{id}`: its owner (the key's record id, `ApiKey.key_id`, never a
secret), its creation time, the id it continued (`previous_response_id`), its own input items, the response object
as the client saw it (output items, usage, status), its size, and for a background response the request the gateway
runs for it (`job`) and a cancel mark. A background response's stream events are a list beside it. Each key has an
index of its responses (a sorted set by creation time) and their sizes, so that its bounds hold: at most
`responses.max_per_key` responses and `responses.max_bytes_per_key` bytes, the oldest evicted first, each gone after
`responses.store_ttl`. Every write of one response is one Lua script: a failure leaves all of it or none of it.

Imports settings, errors, metrics and the Redis boundary (`RedisCalls`: one deadline, one retry, errors mapped to
KeyStoreUnavailableError: a 503 in the route's envelope).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import orjson
import redis.asyncio as redis_asyncio

from gateway.metrics.instruments import GatewayMetrics
from gateway.redis import DirectScript, RedisCalls
from gateway.settings import Settings

RECORD = "nemotron:resp:"
EVENTS = "nemotron:resp-events:"
_INDEX = "nemotron:resp-owner:{}"
_SIZES = "nemotron:resp-sizes:{}"
# Background responses not finished yet (by creation time), and who runs each one (a claim that lapses with its
# runner: another gateway then resumes it).
JOBS = "nemotron:resp-jobs"
_CLAIM = "nemotron:resp-claim:"
# The sizes hash's field holding the owner's total.
_TOTAL = "__total"

# Forget the owner's entries whose time is over (their records expired on their own), then write the record, index
# it (a background response with a job: among the jobs too, KEYS[3]), and evict the owner's oldest until its bounds
# hold; the record just written is never evicted for another. One over the byte bound by itself is not kept (an
# earlier version of it dropped) and evicts nothing: the owner's other responses would all go for it in vain.
# Returns {kept (1/0), evicted}.
_SAVE = """
local index, sizes = KEYS[1], KEYS[2]
local id, owner, now, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local max_items, max_bytes, size = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local record_prefix, events_prefix = ARGV[8], ARGV[9]
local function forget(member)
  local old = tonumber(redis.call('HGET', sizes, member) or '0')
  redis.call('HINCRBY', sizes, '__total', 0 - old)
  redis.call('HDEL', sizes, member)
  redis.call('ZREM', index, member)
end
for _, member in ipairs(redis.call('ZRANGEBYSCORE', index, '-inf', now - ttl * 1000)) do
  forget(member)
end
local record = record_prefix .. id
if redis.call('EXISTS', record) == 1 and redis.call('HGET', record, 'owner') ~= owner then
  return {0, 0}
end
forget(id)
if size > max_bytes then
  redis.call('DEL', record, events_prefix .. id)
  return {0, 0}
end
local fields = {'owner', owner, 'size', size}
for i = 10, #ARGV, 2 do
  fields[#fields + 1] = ARGV[i]
  fields[#fields + 1] = ARGV[i + 1]
end
redis.call('HSET', record, unpack(fields))
redis.call('HSETNX', record, 'created', now)
redis.call('EXPIRE', record, ttl)
redis.call('ZADD', index, tonumber(redis.call('HGET', record, 'created')), id)
redis.call('HSET', sizes, id, size)
redis.call('HINCRBY', sizes, '__total', size)
if KEYS[3] then redis.call('ZADD', KEYS[3], now, id) end
local evicted = 0
while true do
  local total = tonumber(redis.call('HGET', sizes, '__total') or '0')
  local count = redis.call('ZCARD', index)
  if count <= max_items and total <= max_bytes then break end
  local oldest = redis.call('ZRANGE', index, 0, 1)
  local victim = oldest[1]
  if victim == id then victim = oldest[2] end
  if victim == nil then break end
  forget(victim)
  redis.call('DEL', record_prefix .. victim, events_prefix .. victim)
  evicted = evicted + 1
end
redis.call('EXPIRE', index, ttl)
redis.call('EXPIRE', sizes, ttl)
return {1, evicted}
"""

# The chain ending at ARGV[2]: each response's input and response object, newest first, every link the owner's.
# {'ok', input, response, input, response, ...}, or {'missing', id}, {'cycle', id}, {'too_long'}.
_CHAIN = """
local prefix, cur, owner, most = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local out, seen, count = {'ok'}, {}, 0
while cur and cur ~= '' do
  if seen[cur] then return {'cycle', cur} end
  seen[cur] = true
  count = count + 1
  if count > most then return {'too_long'} end
  local found = redis.call('HMGET', prefix .. cur, 'owner', 'previous', 'input', 'response')
  if found[1] ~= owner or not found[3] or not found[4] then return {'missing', cur} end
  out[#out + 1] = found[3]
  out[#out + 1] = found[4]
  cur = found[2]
end
return out
"""

# Delete one response of the owner's (its record, events, index entry, size, job); 1 when there was one.
_DELETE = """
local index, sizes, jobs = KEYS[1], KEYS[2], KEYS[3]
local id, owner, record_prefix, events_prefix, claim_prefix = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local record = record_prefix .. id
if redis.call('HGET', record, 'owner') ~= owner then return 0 end
redis.call('DEL', record, events_prefix .. id, claim_prefix .. id)
redis.call('ZREM', jobs, id)
redis.call('ZREM', index, id)
local old = tonumber(redis.call('HGET', sizes, id) or '0')
redis.call('HINCRBY', sizes, '__total', 0 - old)
redis.call('HDEL', sizes, id)
return 1
"""

# Delete every response of an owner (its key is deleted); the number deleted.
_DELETE_OWNER = """
local index, sizes, jobs = KEYS[1], KEYS[2], KEYS[3]
local record_prefix, events_prefix, claim_prefix = ARGV[1], ARGV[2], ARGV[3]
local members = redis.call('ZRANGE', index, 0, -1)
for _, id in ipairs(members) do
  redis.call('DEL', record_prefix .. id, events_prefix .. id, claim_prefix .. id)
  redis.call('ZREM', jobs, id)
end
redis.call('DEL', index, sizes)
return #members
"""

# Keep a claim on a background response (its holder's), and say whether it was asked to stop:
# {held (1/0), cancelled (1/0)}.
_RENEW = """
local held = 0
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  held = 1
end
local cancelled = redis.call('HGET', KEYS[2], 'cancel') and 1 or 0
return {held, cancelled}
"""

# Let go of a claim (only the holder's) and, when the response is finished, of its place among the jobs.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
if ARGV[2] == '1' then redis.call('ZREM', KEYS[2], ARGV[3]) end
return 1
"""


# Append a background response's events at their place (ARGV[1]: how many it had): safe to run twice.
_APPEND = """
if redis.call('LLEN', KEYS[1]) ~= tonumber(ARGV[1]) then return 0 end
for i = 3, #ARGV do redis.call('RPUSH', KEYS[1], ARGV[i]) end
redis.call('EXPIRE', KEYS[1], ARGV[2])
return 1
"""


# The oldest ARGV[2] jobs whose claim is gone.
_UNCLAIMED = """
local out = {}
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, tonumber(ARGV[2]) - 1)) do
  if redis.call('EXISTS', ARGV[1] .. id) == 0 then out[#out + 1] = id end
end
return out
"""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class ChainError(Exception):
    """A `previous_response_id` that cannot be continued: `reason` is missing (unknown, expired, deleted or another
    key's), cycle or too_long; `response_id` the link at fault."""

    def __init__(self, reason: str, response_id: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.response_id = response_id


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """One stored response as read back: the response object, its own input items, the id it continued, and for a
    background one the request the gateway runs for it (None once it is done or for any other)."""

    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    previous_response_id: str | None
    job: dict[str, Any] | None
    cancel_requested: bool


@dataclass(frozen=True, slots=True)
class OwnerUsage:
    """What one key keeps stored: responses and bytes."""

    responses: int
    bytes: int


class ResponseStore:
    """The stored responses of every key, in Redis (module docstring)."""

    def __init__(self, redis: redis_asyncio.Redis, settings: Settings, metrics: GatewayMetrics | None = None) -> None:
        self._redis = redis
        self._calls = RedisCalls(settings.redis, metrics)
        self._settings = settings.responses
        self._save = DirectScript(redis, _SAVE)
        self._chain = DirectScript(redis, _CHAIN)
        self._delete = DirectScript(redis, _DELETE)
        self._delete_owner = DirectScript(redis, _DELETE_OWNER)
        self._renew = DirectScript(redis, _RENEW)
        self._release = DirectScript(redis, _RELEASE)
        self._append = DirectScript(redis, _APPEND)
        self._unclaimed = DirectScript(redis, _UNCLAIMED)

    @property
    def ttl(self) -> int:
        """Seconds a stored response is kept."""
        return int(self._settings.store_ttl)

    async def save(
        self,
        owner: str,
        response: dict[str, Any],
        input_items: list[dict[str, Any]],
        *,
        previous_response_id: str | None = None,
        job: dict[str, Any] | None = None,
        now_ms: int | None = None,
    ) -> bool:
        """Store (or update) `response` of `owner`, with its own `input_items`, the id it continued and, for a
        background response not finished yet, its `job` (None clears it; given, the response is among the jobs).
        False when it is not kept: larger than the owner's byte bound by itself, or the id is another owner's.
        Evicts the owner's oldest beyond its bounds."""
        response_id = str(response["id"])
        body, items = orjson.dumps(response), orjson.dumps(input_items)
        state = orjson.dumps(job) if job is not None else b""
        size = len(body) + len(items) + len(state)
        args: list[Any] = [
            response_id,
            owner,
            now_ms if now_ms is not None else int(time.time() * 1000),
            self.ttl,
            self._settings.max_per_key,
            self._settings.max_bytes_per_key,
            size,
            RECORD,
            EVENTS,
            "response",
            body,
            "input",
            items,
            "previous",
            previous_response_id or "",
            "job",
            state,
        ]
        keys = [_INDEX.format(owner), _SIZES.format(owner), *([JOBS] if job is not None else [])]
        kept, _evicted = await self._calls(lambda: self._save(keys=keys, args=args))
        return bool(kept)

    async def get(self, response_id: str, owner: str) -> StoredResponse | None:
        """The owner's stored response `response_id`, or None (unknown, expired, deleted or another key's)."""
        fields = ("owner", "response", "input", "previous", "job", "cancel")
        found = await self._calls(lambda: self._redis.hmget(RECORD + response_id, fields))
        stored_owner, response, items, previous, job, cancel = found
        if stored_owner is None or _text(stored_owner) != owner or response is None:
            return None
        return StoredResponse(
            response=orjson.loads(response),
            input_items=orjson.loads(items) if items else [],
            previous_response_id=_text(previous) if previous else None,
            job=orjson.loads(job) if job else None,
            cancel_requested=cancel is not None,
        )

    async def owner(self, response_id: str) -> str | None:
        """Whose `response_id` is (for the gateway's own resumption of a background run), or None."""
        found = await self._calls(lambda: self._redis.hget(RECORD + response_id, "owner"))
        return _text(found) if found is not None else None

    async def chain(self, response_id: str, owner: str) -> list[tuple[list[dict[str, Any]], dict[str, Any]]]:
        """The conversation that `response_id` ends, oldest first: each response's own input items and response
        object. Raises ChainError when a link is missing or another key's, the chain loops, or it holds more than
        `responses.max_chain` responses."""
        args = [RECORD, response_id, owner, self._settings.max_chain]
        found = await self._calls(lambda: self._chain(args=args))
        status = _text(found[0])
        if status != "ok":
            at = _text(found[1]) if len(found) > 1 else response_id
            raise ChainError(status, at)
        links = [(orjson.loads(found[i]), orjson.loads(found[i + 1])) for i in range(1, len(found), 2)]
        links.reverse()
        return links

    async def delete(self, response_id: str, owner: str) -> bool:
        """Delete the owner's `response_id` (its events and job too); whether there was one."""
        keys = [_INDEX.format(owner), _SIZES.format(owner), JOBS]
        args = [response_id, owner, RECORD, EVENTS, _CLAIM]
        return bool(await self._calls(lambda: self._delete(keys=keys, args=args)))

    async def delete_owner(self, owner: str) -> int:
        """Delete every stored response of `owner` (its key is being deleted); how many there were."""
        keys = [_INDEX.format(owner), _SIZES.format(owner), JOBS]
        return int(await self._calls(lambda: self._delete_owner(keys=keys, args=[RECORD, EVENTS, _CLAIM])))

    async def usage(self, owner: str) -> OwnerUsage:
        """How many responses and bytes `owner` keeps (entries past their time included until the next write)."""
        index, sizes = _INDEX.format(owner), _SIZES.format(owner)

        async def read() -> tuple[int, Any]:
            return await self._redis.zcard(index), await self._redis.hget(sizes, _TOTAL)

        count, total = await self._calls(read)
        return OwnerUsage(int(count), int(total or 0))

    async def request_cancel(self, response_id: str) -> None:
        """Mark a background response as asked to stop (its runner sees it at its next renewal)."""
        await self._calls(lambda: self._redis.hset(RECORD + response_id, "cancel", "1"))

    # Background jobs -------------------------------------------------------------------------------------------

    async def claim(self, response_id: str, holder: str, ttl_ms: int) -> bool:
        """Take the run of a background response for `holder` unless someone holds it."""
        return bool(await self._calls(lambda: self._redis.set(_CLAIM + response_id, holder, nx=True, px=ttl_ms)))

    async def renew(self, response_id: str, holder: str, ttl_ms: int) -> tuple[bool, bool]:
        """Keep `holder`'s claim; (still held, asked to stop)."""
        keys = [_CLAIM + response_id, RECORD + response_id]
        held, cancelled = await self._calls(lambda: self._renew(keys=keys, args=[holder, ttl_ms]))
        return bool(held), bool(cancelled)

    async def release(self, response_id: str, holder: str, *, finished: bool) -> None:
        """Let go of `holder`'s claim; a `finished` response leaves the jobs."""
        keys = [_CLAIM + response_id, JOBS]
        await self._calls(lambda: self._release(keys=keys, args=[holder, "1" if finished else "0", response_id]))

    async def unclaimed_jobs(self, limit: int = 100) -> list[str]:
        """Background responses not finished whose run nobody holds (their runner stopped), oldest first."""
        found = await self._calls(lambda: self._unclaimed(keys=[JOBS], args=[_CLAIM, limit]))
        return [_text(response_id) for response_id in found]

    async def append_events(self, response_id: str, start: int, events: list[bytes]) -> None:
        """Add stream events of a background response after its first `start` (kept as long as the response)."""
        args = [start, self.ttl, *events]
        await self._calls(lambda: self._append(keys=[EVENTS + response_id], args=args))

    async def clear_events(self, response_id: str) -> None:
        """Drop a background response's events (its run starts again from the beginning)."""
        await self._calls(lambda: self._redis.delete(EVENTS + response_id))

    async def events(self, response_id: str, start: int) -> list[bytes]:
        """A background response's stream events from index `start` on."""
        found = await self._calls(lambda: self._redis.lrange(EVENTS + response_id, start, -1))
        return [item if isinstance(item, bytes) else item.encode() for item in found]
